"""Front end, input side: prompts become validated `EngineCoreRequest`s before anything reaches the core.

Tokenizes text prompts, checks token ids against the vocabulary, resolves `max_tokens` against
the context window and rejects what can never run (the core's KV cache holds at least
`max_model_len` tokens, checked at start, so the context window also bounds KV use). A prompt
with `n > 1` becomes n core requests with seeds `seed + i`; text-only parameters stay here (stop
strings) or reach the core as token ids (`bad_words`, tokenized as vLLM does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from ember.frontend.content_filter import ContentFilter
from ember.frontend.output import RequestState, child_request_id
from ember.lora.peft import read_adapter
from ember.lora.request import LoRARequest
from ember.messages import EngineCoreReady, EngineCoreRequest
from ember.model.files import ModelInfo
from ember.multimodal.inputs import ImageInput
from ember.multimodal.media import MediaConnector
from ember.pooling.params import POOLING_ONLY, PoolingParams, task_problem
from ember.sampling.params import INT64_MIN, SamplingParams
from ember.sampling.structured import GrammarCheck, StructuredOutputsParams, check_grammar
from ember.tokenizer import Tokenizer

PromptType = str | list[int] | dict[str, Any]
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def needs_tokenizing(prompt: PromptType) -> bool:
    """Whether `prompt` is text to tokenize rather than token ids (or something invalid, found by `process`)."""
    return isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt)


@dataclass
class ProcessedRequest:
    state: RequestState  # the front end's side
    core_requests: list[EngineCoreRequest]  # the core's side: one per sequence


def load_content_filter(blocked_words: str | list[str] | None) -> ContentFilter | None:
    """`EngineArgs.blocked_words` as a filter: a string names a file, a list holds the phrases."""
    if blocked_words is None:
        return None
    return ContentFilter.from_file(blocked_words) if isinstance(blocked_words, str) else ContentFilter(blocked_words)


class Processor:
    def __init__(
        self,
        info: ModelInfo,
        ready: EngineCoreReady,
        content_filter: ContentFilter | None = None,
        media: MediaConnector | None = None,
    ) -> None:
        """`media`: where images may come from and their limits (default: vLLM's, no local files)."""
        self.media = media or MediaConnector()
        self.tokenizer: Tokenizer | None = info.tokenizer
        self.content_filter = content_filter
        self.generation_config = info.generation_config
        self.eos_token_ids = info.eos_token_ids
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.lora_shapes = ready.lora
        self.hidden_size = ready.hidden_size
        self.pooling_only = ready.runner == "pooling"
        self.images = None
        if ready.vision is not None:
            # Here, for vision models only: the image processors import numpy, 36 ms of the front end's
            # start (median of 3, 2-core EPYC, 2026-12-07) that a text model never needs.
            from ember.multimodal.preprocess import image_processor

            self.images = image_processor(ready.vision, info.image_processor)
        self.encoder, self.num_labels = ready.encoder, ready.num_labels
        self._checked_loras: set[LoRARequest] = set()  # adapters that passed check_lora (files read once)
        self._grammar_check = GrammarCheck(self.tokenizer, self.vocab_size) if self.tokenizer is not None else None

    def check_grammar(self, params: StructuredOutputsParams, field: str | None = None) -> None:
        """A ValueError naming `field` when the constraint cannot run on this model (see GrammarCheck)."""
        if self._grammar_check is None:  # no vocabulary here; the core says why it cannot constrain
            check_grammar(params, field)
        else:
            self._grammar_check(params, field)

    def check_lora(self, lora: LoRARequest) -> None:
        """A ValueError naming the field or file when the adapter cannot run on this engine: LoRA off, a bad
        request, or an adapter directory that is missing, unsupported or shaped for another model. The
        core checks again (and reads the tensors) when the request arrives."""
        if lora in self._checked_loras:
            return
        if self.lora_shapes is None:
            raise ValueError(
                "lora_request: LoRA is not enabled on this engine; start it with enable_lora=True (--enable-lora)"
            )
        lora.check()
        read_adapter(lora.lora_path, self.lora_shapes)
        self._checked_loras.add(lora)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults, as vLLM does."""
        return SamplingParams(
            **{k: self.generation_config[k] for k in GENERATION_FIELDS if self.generation_config.get(k) is not None}
        )

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError(
                "prompt must be a string, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'"
            )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model was loaded without a tokenizer; pass prompt_token_ids")
            return prompt, self._check_token_ids(self.tokenizer.encode(prompt))
        if isinstance(prompt, list):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_token_ids(self, ids: Any) -> list[int]:
        """The ids checked in C loops (a set of their types, min, max): a Python loop over each id cost 13 us
        per 32-token prompt, a fifth of an embedding request's front-end time."""
        if not isinstance(ids, list) or not ids:
            raise ValueError("prompt must not be empty")
        if set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if type(t) is not int or not 0 <= t < self.vocab_size)
            raise ValueError(f"prompt_token_ids must be integers in [0, {self.vocab_size}), got {bad!r}")
        return list(ids)

    def _check_vocabulary_bounds(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids and top_k against this model's vocabulary."""
        if params.top_k > self.vocab_size:
            raise ValueError(
                f"top_k must be -1, 0 or in [1, {self.vocab_size}] (the vocabulary size), got {params.top_k}"
            )
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids or ()),
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("bad_words_token_ids", [t for seq in params.bad_words_token_ids or () for t in seq]),
        ):
            for t in ids:
                if t >= self.vocab_size:
                    raise ValueError(f"{name} must be token ids in [0, {self.vocab_size}), got {t}")

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]] | None:
        """`bad_words_token_ids` with `bad_words` tokenized and added, as vLLM's `update_from_tokenizer` does:
        each word as given (leading spaces stripped) and, when that gives another first token in as many
        tokens, after a space, so that the word is banned both at the start of the text and after a space."""
        if not params.bad_words:
            return params.bad_words_token_ids
        if self.tokenizer is None:
            raise ValueError("bad_words: this model was loaded without a tokenizer; pass bad_words_token_ids")
        sequences = list(params.bad_words_token_ids or [])
        for word in params.bad_words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not bare:
                raise ValueError(f"bad_words: {word!r} tokenizes to no tokens")
            sequences.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        for t in (t for seq in sequences for t in seq):
            if t >= self.vocab_size:
                raise ValueError(f"bad_words: a word's token id {t} is outside the vocabulary [0, {self.vocab_size})")
        return sequences

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> ProcessedRequest:
        """Tokenize and validate, touching no engine state (any thread may call it); a ValueError naming
        the field when the request can never run. With `pooling_params` it is an embedding request:
        its sampling parameters are ignored."""
        if pooling_params is not None:
            return self._process_pooling(request_id, prompt, pooling_params, arrival_time, lora_request)
        if self.pooling_only:
            raise ValueError(POOLING_ONLY)
        params = params or self.default_sampling_params()
        if lora_request is not None:
            self.check_lora(lora_request)
        self._check_vocabulary_bounds(params)
        bad_words_token_ids = self.bad_words_token_ids(params)
        if params.structured_outputs is not None:
            self.check_grammar(params.structured_outputs)
        text, ids, images = self._prompt_with_images(prompt)
        n_prompt = len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len or max_tokens < 1:
            raise ValueError(
                f"max_tokens: this model's maximum context length is {self.max_model_len} tokens, "
                f"but {n_prompt + max(max_tokens, 1)} were requested ({n_prompt} in the prompt, "
                f"{max(max_tokens, 1)} to generate)"
            )
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState(request_id, text, ids, params, self.tokenizer, arrival, self.content_filter)
        core = []
        for i in range(params.n):
            seed = None if params.seed is None else _child_seed(params.seed, i)
            child = replace(params, n=1, seed=seed, stop=None, bad_words=None, bad_words_token_ids=bad_words_token_ids)
            core.append(
                EngineCoreRequest(
                    child_request_id(request_id, i, params.n),
                    ids,
                    child,
                    max_tokens,
                    self.eos_token_ids,
                    arrival,
                    lora_request,
                    images=images,
                )
            )
        return ProcessedRequest(state, core)

    def _prompt_with_images(self, prompt: PromptType) -> tuple[str | None, list[int], list[ImageInput]]:
        """The prompt tokenized, with the images of vLLM's `multi_modal_data` {"image": one or a list} in
        place of its placeholders (the model's own: Gemma 3's `<start_of_image>`, Qwen2.5-VL's `<|image_pad|>`).
        An image is a PIL image, bytes, a path or a URL (loaded by `self.media`, under its limits)."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            text, ids = self.tokenize_prompt(prompt)
            return text, ids, []
        assert isinstance(prompt, dict)  # a dict holds multi_modal_data
        if self.images is None:
            raise ValueError("multi_modal_data: this model does not accept image input")
        unknown = set(data) - {"image"}
        if unknown:
            raise ValueError(f"multi_modal_data: only 'image' is supported, got {sorted(unknown)}")
        sources = data["image"] if isinstance(data["image"], list) else [data["image"]]
        self.media.check_count(len(sources))
        try:
            images = [self.media.load(source) for source in sources]
        except ValueError as e:
            raise ValueError(f"multi_modal_data.image: {e}") from None
        tok = self.tokenizer
        if "prompt_token_ids" in prompt or tok is None:
            text, ids = self.tokenize_prompt({"prompt_token_ids": prompt.get("prompt_token_ids")})
            ids = self._check_token_ids(self.images.expand_ids(ids, images, tok))
        else:
            text = prompt.get("prompt")
            if not isinstance(text, str):
                raise ValueError("prompt must be a string or prompt_token_ids given with multi_modal_data")
            text, ids = self.tokenize_prompt(self.images.expand_text(text, images, tok))
        return text, ids, self.images.inputs(ids, images)

    def _process_pooling(
        self,
        request_id: str,
        prompt: PromptType,
        pooling: PoolingParams,
        arrival_time: float | None,
        lora_request: LoRARequest | None,
    ) -> ProcessedRequest:
        """An embedding request: its prompt (its last `truncate_prompt_tokens`, as vLLM keeps) must fit the
        context window, and `dimensions` the hidden size. It computes the prompt and generates nothing."""
        if lora_request is not None:
            self.check_lora(lora_request)
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            raise ValueError("multi_modal_data: embeddings and scores of images are not supported yet")
        problem = task_problem(pooling, self.encoder, self.num_labels)
        if problem is not None:
            raise ValueError(problem)
        if pooling.dimensions is not None and pooling.dimensions > self.hidden_size:
            raise ValueError(
                f"dimensions: {pooling.dimensions} is more than this model's embedding size {self.hidden_size}"
            )
        text, ids = self.tokenize_prompt(prompt)
        keep = pooling.truncate_prompt_tokens
        if keep is not None:
            ids = ids[-(self.max_model_len if keep == -1 else keep) :]
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"input: this model's maximum context length is {self.max_model_len} tokens, but the input has "
                f"{len(ids)} (truncate_prompt_tokens cuts it)"
            )
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState(request_id, text, ids, _POOLING_PARAMS, self.tokenizer, arrival, None)
        core = EngineCoreRequest(request_id, ids, _POOLING_PARAMS, 1, [], arrival, lora_request, pooling)
        return ProcessedRequest(state, [core])


# A pooling request's sampling parameters: one token's budget, never read otherwise and never changed, so
# one instance serves every request (building one per request was 28 us, a tenth of LLM.embed's time per input)
_POOLING_PARAMS = SamplingParams(max_tokens=1)


def _child_seed(seed: int, index: int) -> int:
    """Sequence `index`'s seed, `seed + index` wrapped into int64 (seeds near the top stay valid)."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


class ModelFacts:
    """What both front ends (`LLMEngine`, `AsyncLLM`) answer about the model they serve."""

    processor: Processor
    ready: EngineCoreReady

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.processor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.ready.vocab_size

    @property
    def is_encoder(self) -> bool:
        """An encoder model (BERT, XLM-R): it scores a pair as a cross-encoder, from the tokenized pair."""
        return self.ready.encoder

    def default_sampling_params(self) -> SamplingParams:
        return self.processor.default_sampling_params()

    def check_grammar(self, params: StructuredOutputsParams, field: str | None = None) -> None:
        """A ValueError naming `field` when this constraint cannot run on the model; any thread may call
        it (the first call builds the grammar vocabulary: a fraction of a second)."""
        self.processor.check_grammar(params, field)
