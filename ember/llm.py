"""The offline API, vLLM-compatible: `LLM(model).generate(prompts, sampling_params)` and `.chat(...)`.

An entry point like `ember serve` rather than a part of the front end: `run_batch` answers each line
with the server's own request code (`ember.batch.local`), so `LLM` sits above both."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from tqdm.auto import tqdm

from ember.config import EngineArgs
from ember.frontend.engine import LLMEngine
from ember.frontend.output import EmbeddingRequestOutput, RequestOutput, ScoringRequestOutput
from ember.frontend.processor import Processor, PromptType
from ember.lora.request import LoRARequest
from ember.multimodal.parts import NO_VISION, load_images, split_images
from ember.pooling.params import PoolingParams
from ember.pooling.score import ScoreConfig, score_pairs, score_requests
from ember.sampling.params import SamplingParams
from ember.tokenizer import Tokenizer

if TYPE_CHECKING:
    from ember.batch.runner import BatchSummary

Conversation = list[dict[str, Any]]
logger = logging.getLogger("ember")


class LLM:
    """Batch generation in the calling thread; engine arguments as keyword arguments (see `EngineArgs`)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.engine_args)
        logger.info(self.llm_engine.ready.description)

    def get_tokenizer(self) -> Tokenizer | None:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. `lora_request`: the adapter every
        prompt runs under, or one per prompt (None: the base model); needs `enable_lora=True`."""
        # casts: one prompt and a list of them are told apart by their first item, which no type narrows
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            prompts = [cast(PromptType, prompts)]
        prompts = list(cast(Sequence[PromptType], prompts))
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        return self._run(prompts, params_list, use_tqdm, loras)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (vLLM's `LLM.embed`): the prompt's final hidden states
        pooled as the engine's pooler config says (docs/pooling.md). Any engine embeds; no mode switch."""
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            prompts = [cast(PromptType, prompts)]
        prompts = list(cast(Sequence[PromptType], prompts))
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling = [pooling_params or PoolingParams()] * len(prompts)
        else:
            pooling = list(pooling_params)
            if len(pooling) != len(prompts):
                raise ValueError(f"pooling_params: got {len(pooling)} for {len(prompts)} prompts")
        params = [SamplingParams(max_tokens=1)] * len(prompts)
        outputs = self._run(prompts, params, use_tqdm, [lora_request] * len(prompts), pooling)
        return [EmbeddingRequestOutput.of(out) for out in outputs]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
        instruction: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score` (docs/pooling.md): one score per pair, text_1 against each text_2 (1:N) or
        pairwise (N:N). A cross-encoder's is the sigmoid of its classifier's logit on the pair; a decoder
        reranker's (Qwen3-Reranker style) P(true token) of the prompt the engine's `score_config` builds
        (`instruction` overrides its default instruction)."""
        pairs = score_pairs(
            text_1 if isinstance(text_1, str) else list(text_1), text_2 if isinstance(text_2, str) else list(text_2)
        )
        config = ScoreConfig.parse(self.engine_args.score_config or ScoreConfig())
        engine = self.llm_engine
        if engine.tokenizer is None:
            raise ValueError("score needs the model's tokenizer (the engine was started without one)")
        requests = score_requests(pairs, engine.tokenizer, config, engine.is_encoder, engine.vocab_size, instruction)
        prompts: list[PromptType] = [prompt for prompt, _ in requests]
        params = [SamplingParams(max_tokens=1)] * len(prompts)
        pooling = [p for _, p in requests]
        outputs = self._run(prompts, params, use_tqdm, [lora_request] * len(prompts), pooling)
        return [ScoringRequestOutput.of(out) for out in outputs]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate. A vision model's
        messages may hold image parts as the server takes them: `{"type": "image_url", "image_url": {"url":
        ...}}` (data:, http(s):// and, under `allowed_local_media_path`, file:// URLs) or vLLM's
        `{"type": "image_pil", "image_pil": <PIL image>}`."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer, and this model was loaded without one")
        # cast: one conversation and a list of them are told apart by their first item, which no type narrows
        conversations = cast(
            list[Conversation], [messages] if messages and isinstance(messages[0], dict) else list(messages)
        )
        prompts = [
            chat_prompt(self.llm_engine.processor, c, add_generation_prompt, chat_template) for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def run_batch(
        self,
        requests: str | os.PathLike[str] | Sequence[str | dict[str, Any]],
        output_path: str | os.PathLike[str],
        max_concurrency: int | None = None,
        max_retries: int = 3,
        retry_delay: float = 1.0,
        request_timeout: float | None = None,
        use_tqdm: bool = True,
    ) -> BatchSummary:
        """`ember run-batch` in the library: an OpenAI Batch API JSONL file (or a list of its lines as
        dicts) through the server's request code on this engine, all at once; records go to
        `output_path` as they finish, and lines it already answers are skipped (see docs/batch.md).
        Runs its own event loop, so call it from synchronous code."""
        from ember.batch.local import run_on_llm_engine
        from ember.batch.runner import BatchOptions

        options = BatchOptions(
            max_concurrency=max_concurrency or 2 * self.engine_args.max_num_seqs,
            max_retries=max_retries,
            retry_delay=retry_delay,
            request_timeout=request_timeout,
            progress=use_tqdm,
        )
        return asyncio.run(run_on_llm_engine(self.engine_args, self.llm_engine, requests, output_path, options))

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
        pooling: list[PoolingParams] | None = None,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras)):
                pool = None if pooling is None else pooling[i]
                ids.append(engine.add_request(None, prompt, p, final_only=True, lora_request=lora, pooling_params=pool))
        except Exception:
            engine.abort_request(ids)
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        n_in = n_out = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        n_in += len(out.prompt_token_ids)
                        n_out += sum(len(o.token_ids) for o in out.outputs)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"input: {n_in / elapsed:.1f} tok/s, output: {n_out / elapsed:.1f} tok/s")
                        bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]


def chat_prompt(
    processor: Processor, messages: Conversation, add_generation_prompt: bool = True, chat_template: str | None = None
) -> PromptType:
    """One conversation as the engine's prompt: the template's text, its token ids and, when its messages
    hold image parts, the images loaded (by the processor's media rules) as `multi_modal_data`."""
    tokenizer = processor.tokenizer
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer, and this model was loaded without one")
    messages, sources = split_images(messages)
    if sources and processor.images is None:
        raise ValueError(f"messages: {NO_VISION}")
    images = load_images(processor.media, sources) if sources else []
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, chat_template=chat_template
    )
    prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    return prompt
