"""`LLMEngine`: add requests, step, abort. The one engine behind both the offline and async front ends.

One `step()` is: schedule -> model runner (forward + sample) -> append tokens, detokenize, check
stops -> free finished requests' blocks -> `RequestOutput`s for every request that changed.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Union

import torch

from ember.chat_template import load_chat_template
from ember.config import EngineArgs, ModelConfig
from ember.engine.block_manager import BlockManager
from ember.engine.metrics import StepStats
from ember.engine.output import (CompletionOutput, IncrementalDetokenizer, RequestOutput, check_stop_token,
                                 make_logprobs)
from ember.engine.request import Request, RequestStatus
from ember.engine.scheduler import Scheduler
from ember.model.loader import load_model_files
from ember.model.sharding import check_divisible
from ember.runner.model_runner import ModelRunner
from ember.runner.tp_workers import TensorParallelGroup, launched_by_torchrun, serve_as_torchrun_worker
from ember.sampling.params import SamplingParams

logger = logging.getLogger("ember")

PromptType = Union[str, list[int], dict[str, Any]]
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(eq=False)
class _Sequence:
    """A Request with its detokenizer; `n > 1` gives several per parent."""

    request: Request
    detok: IncrementalDetokenizer
    num_emitted_tokens: int = 0


@dataclass(eq=False)
class PreparedRequest:
    """A validated request (with its n sequences), ready to enter the scheduler."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Sequence]
    error: str | None = None
    final_only: bool = False  # report only the final output (offline use): no per-step output objects

    @property
    def finished(self) -> bool:
        return all(s.request.status.finished for s in self.seqs)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        start = time.monotonic()
        if args.tensor_parallel_size > 1 and launched_by_torchrun() and int(os.environ["RANK"]) != 0:
            serve_as_torchrun_worker(args)  # rank 0's follower: loads its own shard; does not return
        files = load_model_files(args)
        self.args = args
        self.tokenizer = files.tokenizer
        if args.chat_template is not None and self.tokenizer is not None:
            self.tokenizer.chat_template = load_chat_template(args.chat_template)
        self.model_config = files.model_config
        self.generation_config = files.generation_config
        device = args.torch_device
        self.cache_config = args.cache_config()
        self.scheduler_config = args.scheduler_config(files.model_config, device)
        self.tensor_parallel = self._start_tensor_parallel(args, files.model_config)
        try:
            self.runner = ModelRunner(files, args, self.cache_config, self.scheduler_config,
                                      self.tensor_parallel.device if self.tensor_parallel else None)
            num_blocks = self.runner.prepare_cache()
        except RuntimeError as e:  # under tensor parallelism, often a rank that died
            if self.tensor_parallel is None:
                raise
            error = self.tensor_parallel.step_failed(e)
            self.tensor_parallel.stop()
            raise error from e
        except BaseException:
            if self.tensor_parallel is not None:
                self.tensor_parallel.stop()
            raise
        if self.tensor_parallel is not None:
            self.tensor_parallel.ready()
        self.block_manager = BlockManager(num_blocks, self.cache_config.block_size,
                                          self.cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        self.eos_token_ids = files.tokenizer.eos_token_ids if files.tokenizer else []
        self.max_model_len = self.scheduler_config.max_model_len
        self.kv_capacity_tokens = num_blocks * self.cache_config.block_size
        if self.kv_capacity_tokens < self.max_model_len:
            # Otherwise a request within the context window could never be scheduled.
            raise ValueError(f"max_model_len ({self.max_model_len}) is larger than the KV cache can hold "
                             f"({self.kv_capacity_tokens} tokens); lower --max-model-len or raise --kv-cache-memory "
                             f"/ --gpu-memory-utilization")
        self._parents: dict[str, PreparedRequest] = {}
        self.stat_loggers: list[Callable[[StepStats], None]] = []
        self._ids = itertools.count()
        self.ready_message = (
            f"model {files.source} on {device} ({str(self.runner.dtype).replace('torch.', '')}, "
            f"quantization {self.runner.quantization}, weights {self.runner.weight_bytes / 2**30:.2f} GiB, "
            f"KV {str(self.runner.kv_dtype).replace('torch.', '')}): {num_blocks} KV blocks of "
            f"{self.cache_config.block_size} "
            f"tokens ({num_blocks * self.runner.bytes_per_block / 2**30:.2f} GiB), max concurrency "
            f"{self.kv_capacity_tokens / self.max_model_len:.1f}x at {self.max_model_len} tokens; "
            f"ready in {time.monotonic() - start:.1f}s")
        logger.debug(self.ready_message)

    @staticmethod
    def _start_tensor_parallel(args: EngineArgs, model_config: ModelConfig) -> TensorParallelGroup | None:
        if args.tensor_parallel_size == 1:
            return None
        check_divisible(model_config, args.tensor_parallel_size)
        group = TensorParallelGroup(args)
        atexit.register(group.stop)
        return group

    def shutdown(self) -> None:
        """End the tensor-parallel worker processes (nothing to do with one rank). Idempotent."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.stop()

    # ---- requests ---------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults, as vLLM does."""
        return SamplingParams(**{k: self.generation_config[k] for k in _GENERATION_DEFAULTS
                                 if self.generation_config.get(k) is not None})

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                             "'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model was loaded without a tokenizer; pass prompt_token_ids")
            return prompt, self._check_token_ids(self.tokenizer.encode(prompt))
        if isinstance(prompt, list):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_token_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, list) or not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}), got {t!r}")
        return list(ids)

    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                     arrival_time: float | None = None, final_only: bool = False) -> "PreparedRequest":
        """Tokenize and validate without touching engine state, so front ends may call it from any thread.

        Raises ValueError when the request can never run.
        """
        params = params or self.default_sampling_params()
        text, ids = self.tokenize_prompt(prompt)
        n_prompt = len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len or max_tokens < 1:
            raise ValueError(f"max_tokens: this model's maximum context length is {self.max_model_len} tokens, "
                             f"but {n_prompt + max(max_tokens, 1)} were requested ({n_prompt} in the prompt, "
                             f"{max(max_tokens, 1)} to generate)")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = []
        for i in range(params.n):
            child = params if params.n == 1 else replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            generator = None
            if child.seed is not None:
                generator = torch.Generator(device=self.runner.device).manual_seed(child.seed)
            req = Request(request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                          prompt_token_ids=ids, sampling_params=child, max_tokens=max_tokens,
                          eos_token_ids=self.eos_token_ids, generator=generator, parent_id=request_id,
                          index=i, arrival_time=arrival)
            seqs.append(_Sequence(req, IncrementalDetokenizer(self.tokenizer, ids, child)))
        return PreparedRequest(request_id, text, ids, seqs, final_only=final_only)

    def add_prepared(self, parent: "PreparedRequest") -> None:
        if parent.request_id in self._parents:
            raise ValueError(f"request_id {parent.request_id!r} is already in use")
        self._parents[parent.request_id] = parent
        for s in parent.seqs:
            self.scheduler.add(s.request)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, final_only: bool = False) -> str:
        """Validate and queue a request; raises ValueError (and queues nothing) when it can never run.

        With `final_only`, `step()` returns this request's output only once, when it finishes.
        """
        request_id = str(next(self._ids)) if request_id is None else request_id
        self.add_prepared(self.make_request(request_id, prompt, params, arrival_time, final_only))
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests now and free their KV blocks; returns their final outputs."""
        outputs = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            live = [s.request for s in parent.seqs if not s.request.status.finished]
            for req in live:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            outputs.append(self._make_output(parent))
            self._log_stats(time.monotonic(), [], live)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._parents)

    # ---- stepping ---------------------------------------------------------------------------

    def step(self, defer: Callable[[str], bool] | None = None) -> list[RequestOutput]:
        """One engine step. A request for which `defer(request_id)` is true gets no output this step
        unless it finished; its next output's deltas then cover both steps (a front end uses this
        while its consumer has not read the last output yet)."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self.tensor_parallel is not None:
            self.tensor_parallel.check()
        try:
            result = self.runner.execute(batch, self.eos_token_ids)
        except Exception as e:  # the model failed: fail this batch's requests, keep the engine alive
            if self.tensor_parallel is not None:  # unless the ranks may be out of step: then the engine stops
                raise self.tensor_parallel.step_failed(e) from e
            logger.exception("model step failed; aborting the %d requests in the batch", len(batch))
            return self._fail({r.parent_id for r in batch.requests}, e)
        self.scheduler.after_step(batch)
        for req, entries in result.prompt_logprobs.items():
            for position, pairs, rank in entries:
                if position == len(req.prompt_logprobs):  # not already there from before a preemption
                    req.prompt_logprobs.append(make_logprobs(self.tokenizer, pairs, rank))
        now = time.monotonic()
        changed: dict[str, PreparedRequest] = {}
        failed: dict[str, Exception] = {}
        sampled: list[Request] = []
        finished: list[Request] = []
        for req, token, logprobs in zip(result.requests, result.token_ids, result.logprobs):
            parent = self._parents[req.parent_id]
            try:
                if self._process_token(parent.seqs[req.index], token, logprobs, now):
                    finished.append(req)
            except Exception as e:  # one request's output processing failed: fail only that request
                logger.exception("request %s failed while processing its output", req.parent_id)
                failed[req.parent_id] = e
                continue
            sampled.append(req)
            changed[parent.request_id] = parent
        outputs = self._fail(set(failed), *failed.values()) if failed else []
        for parent in changed.values():
            done = parent.finished
            if parent.request_id in failed or (not done and (parent.final_only or (
                    defer is not None and defer(parent.request_id)))):
                continue
            outputs.append(self._make_output(parent))
            if done:
                del self._parents[parent.request_id]
        self._log_stats(now, sampled, finished)
        return outputs

    def _process_token(self, seq: _Sequence, token: int, logprobs: tuple[list[tuple[int, float]], int] | None,
                       now: float) -> bool:
        """Append a sampled token, detokenize, check stops; True when the sequence finished."""
        req = seq.request
        req.append_token(token)
        if req.first_token_time is None:
            req.first_token_time = now
        if logprobs is not None:
            pairs, rank = logprobs
            req.logprobs.append(make_logprobs(self.tokenizer, pairs, rank))
            req.cumulative_logprob += pairs[0][1]
        status = check_stop_token(req, token, self.max_model_len)
        if status is not RequestStatus.FINISHED_STOPPED:
            stop = seq.detok.update(token)
            if stop is not None:
                req.stop_reason, status = stop, RequestStatus.FINISHED_STOPPED
        if status is None:
            return False
        seq.detok.flush()
        self.scheduler.finish(req, status)
        return True

    def _fail(self, request_ids: set[str], *errors: Exception) -> list[RequestOutput]:
        message = "; ".join(f"{type(e).__name__}: {e}" for e in errors) or "internal error"
        for rid in request_ids:
            if rid in self._parents:
                self._parents[rid].error = message
        return self.abort_request(sorted(request_ids))

    def _log_stats(self, now: float, sampled: list[Request], finished: list[Request]) -> None:
        if not self.stat_loggers:
            return
        bm = self.block_manager
        stats = StepStats(now=now, num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                          kv_cache_usage=bm.usage, prefix_cache_queries=bm.prefix_cache_queries,
                          prefix_cache_hits=bm.prefix_cache_hits, num_preemptions=self.scheduler.num_preemptions,
                          sampled=sampled, finished=finished)
        for log in self.stat_loggers:
            log(stats)

    def _make_output(self, parent: PreparedRequest) -> RequestOutput:
        outs = []
        for s in parent.seqs:
            req = s.request
            finished = req.status.finished
            delta_text = s.detok.take_delta(finished)
            delta_tokens = req.output_token_ids[s.num_emitted_tokens:]
            s.num_emitted_tokens = req.num_output_tokens
            outs.append(CompletionOutput(
                index=req.index,
                text=s.detok.text if finished else s.detok.text[: s.detok.emitted],
                token_ids=list(req.output_token_ids),
                cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                logprobs=req.logprobs,
                finish_reason=req.status.value if finished else None,
                stop_reason=req.stop_reason,
                delta_text=delta_text,
                delta_token_ids=delta_tokens,
            ))
        return RequestOutput(request_id=parent.request_id, prompt=parent.prompt,
                             prompt_token_ids=parent.prompt_token_ids, outputs=outs, finished=parent.finished,
                             num_cached_tokens=max(parent.seqs[0].request.num_cached_tokens, 0),
                             error=parent.error, prompt_logprobs=parent.seqs[0].request.prompt_logprobs)
