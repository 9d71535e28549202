"""`EngineCore`: scheduler, KV block manager, model runner and sampler. Token ids in, token ids out.

It never sees text: requests arrive as `EngineCoreRequest` messages (prompt token ids, sampling
parameters, resolved `max_tokens`, EOS ids) and each step answers with `EngineCoreOutputs` (new
token ids, logprobs as arrays, finish reasons, stats). Stop strings are the front end's: it aborts
a request whose text hit one. The core checks what needs only token ids: EOS, stop token ids,
`max_tokens` and the context window.

A step is launched on the device, then collected. With async scheduling (on by default with one
CUDA GPU) two steps are in flight: step N+1 is scheduled and launched while step N still runs,
its decode inputs taken on the device from step N's sampled ids, and only then are step N's
results read back and turned into outputs; the GPU no longer waits for the host between steps.
Requests whose next step needs every earlier token on the host (penalties, prompt logprobs)
make the core fall back to one step at a time while they run. Grammar masks do not: the mask
thread feeds step N's tokens to the matchers and fills step N+1's masks while step N+1's forward
runs, and the runner samples step N+1 only when the core launches N+2 (see `ModelRunner.launch`).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import torch

from ember.config import EngineConfig
from ember.core.block_manager import BlockManager
from ember.core.grammar import GrammarManager, consume
from ember.core.ngram import propose_ngram
from ember.core.request import Request, RequestStatus
from ember.core.scheduler import DraftPolicy, ScheduledBatch, Scheduler
from ember.core.spec_stats import SpecDecodeCounts
from ember.lora.request import LoRARequest
from ember.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    Logprobs,
    SchedulerStats,
)
from ember.model.hf_config import ModelConfig, QwenVisionConfig, VisionConfig
from ember.model.loader import load_model_files
from ember.model.sharding import check_divisible
from ember.multimodal.inputs import QWEN25_VL_FAMILY, ImageInput, VisionFacts
from ember.pooling.params import (
    POOLING_ONLY,
    PoolerConfig,
    PoolingParams,
    task_problem,
)
from ember.runner.device import resolve_device
from ember.runner.model_runner import ModelRunner, PendingStep
from ember.runner.step import StepResult
from ember.runner.tp_workers import TensorParallelGroup

logger = logging.getLogger("ember")
# With n-gram drafts, steps overlap (async scheduling) while the lookup finds nothing; one step in this
# many goes alone, so the lookup sees every token and drafting can resume.
NGRAM_PROBE_STEPS = 8


class EngineCore:
    UTILITIES = ("reset_prefix_cache", "stats")  # the methods a UtilityCall may name

    def __init__(self, config: EngineConfig) -> None:
        start = time.monotonic()
        files = load_model_files(config.load)
        device = resolve_device(config.device)
        self.runner_kind = config.resolved_runner(files.model_config)
        self.encoder = files.model_config.encoder
        self.vision = files.model_config.vision
        self.scheduler_config = config.scheduler_config(files.model_config, device)
        self.max_model_len = self.scheduler_config.max_model_len
        self.vocab_size = files.model_config.vocab_size
        self.hidden_size = files.model_config.hidden_size
        self.pooler = config.pooler or files.pooler or PoolerConfig()
        _check_linear_attention(config, files.model_config)
        self.tensor_parallel = _start_tensor_parallel(config, files.model_config)
        try:
            runner_device = self.tensor_parallel.device if self.tensor_parallel else device
            runner_config = config.runner_config(runner_device, files.checkpoint_dtype)
            self.runner = ModelRunner(
                files,
                dataclasses.replace(runner_config, pooler=self.pooler),
                config.cache,
                self.scheduler_config,
                runner_device,
                config.speculative,
                config.lora,
            )
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
        self.runner.warm_up_kernels()
        self.block_manager = BlockManager(
            num_blocks,
            config.cache.block_size,
            _prefix_caching(config, files.model_config),
            sliding_window=_shared_window(files.model_config),
        )
        self.speculative = config.speculative
        self.scheduler = Scheduler(
            self.scheduler_config,
            self.block_manager,
            DraftPolicy.of(self.speculative, runner_device.type),
            max_loras=config.lora.max_loras if config.lora is not None else None,
        )
        self.spec_counts = SpecDecodeCounts.empty(self.speculative.num_speculative_tokens if self.speculative else 0)
        # Before anything below calls shutdown().
        self.grammar = GrammarManager(config.load, self.vocab_size, files.model_info)
        capacity = num_blocks * config.cache.block_size
        if capacity < self.max_model_len:
            self.shutdown()  # otherwise a request within the context window could never be scheduled
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the KV cache can hold "
                f"({capacity} tokens); lower --max-model-len or raise --kv-cache-memory "
                f"/ --gpu-memory-utilization"
            )
        self.async_scheduling = _resolve_async_scheduling(
            config.async_scheduling, config.tensor_parallel_size, runner_device.type
        )
        self.requests: dict[str, Request] = {}
        self._inflight: deque[tuple[ScheduledBatch, PendingStep]] = deque()
        self._pending: list[EngineCoreOutput] = []  # rejections, sent with the next step's outputs
        self._num_host_sync = 0  # unfinished requests that need one step at a time
        self._num_steps = 0
        self._num_received = 0
        self._grammar_fed: Future | None = None  # the newest mask fill's feeding of late tokens
        self.ready = self._ready_message(
            files.source, num_blocks, config.cache.block_size, config.tensor_parallel_size, time.monotonic() - start
        )
        logger.debug(self.ready.description)

    def _ready_message(self, source: str, num_blocks: int, block_size: int, tp: int, seconds: float) -> EngineCoreReady:
        r = self.runner
        dtype, kv_dtype = (str(d).removeprefix("torch.") for d in (r.dtype, r.kv_dtype))
        description = (
            f"model {source} on {r.device} ({dtype}, quantization {r.quantization}, weights "
            f"{r.weight_bytes / 2**30:.2f} GiB, KV {kv_dtype}): {num_blocks} KV blocks of {block_size} tokens "
            f"({num_blocks * r.bytes_per_block / 2**30:.2f} GiB), max concurrency "
            f"{num_blocks * block_size / self.max_model_len:.1f}x at {self.max_model_len} tokens; "
            f"async scheduling {'on' if self.async_scheduling else 'off'}; ready in {seconds:.1f}s"
        )
        return EngineCoreReady(
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.scheduler_config.max_num_seqs,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            vocab_size=self.vocab_size,
            device=str(r.device),
            dtype=dtype,
            kv_cache_dtype=kv_dtype,
            quantization=r.quantization,
            weight_bytes=r.weight_bytes,
            bytes_per_block=r.bytes_per_block,
            cuda_graphs=r.graphs is not None,
            async_scheduling=self.async_scheduling,
            tensor_parallel_size=tp,
            description=description,
            hidden_size=self.hidden_size,
            pooling_type=self.pooler.pooling_type,
            runner=self.runner_kind,
            vision=None if self.vision is None else _vision_facts(self.vision),
            encoder=self.encoder is not None,
            num_labels=0 if self.encoder is None else self.encoder.num_labels,
            lora=r.lora.shapes if r.lora is not None else None,
        )

    def shutdown(self) -> None:
        """End the tensor-parallel worker processes (nothing to do with one rank). Idempotent."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.stop()
        if self.runner.lora is not None:
            self.runner.lora.shutdown()
        self.grammar.shutdown()

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, msg: EngineCoreRequest) -> None:
        """Queue a request; one the core cannot run is answered at once (with the next outputs) by an
        error. The front end validates first, so this is a second line of defence."""
        self._num_received += 1
        problem = self._check(msg)
        matcher = None
        if problem is None and msg.sampling_params.structured_outputs is not None:
            try:
                matcher = self.grammar.matcher(msg.sampling_params.structured_outputs)
            except ValueError as e:
                problem = str(e)
        if problem is not None:
            self._pending.append(EngineCoreOutput(msg.request_id, [], finish_reason="abort", error=problem))
            return
        req = Request.from_message(msg)
        req.matcher = matcher
        pooling = msg.pooling_params  # a score request pools one token only, whatever the engine's type
        embeds = pooling is not None and pooling.task == "embed"
        req.skip_prefix_cache = embeds and self.pooler.needs_every_token
        self.requests[msg.request_id] = req
        self._num_host_sync += req.needs_host_tokens
        self.scheduler.add(req)

    def _check(self, msg: EngineCoreRequest) -> str | None:
        ids = msg.prompt_token_ids
        if msg.request_id in self.requests:
            return f"request_id {msg.request_id!r} is already in use"
        if not ids or min(ids) < 0 or max(ids) >= self.vocab_size:  # C loops (a generator: 4 us a 32-token prompt)
            return f"prompt_token_ids must be a non-empty list of integers in [0, {self.vocab_size})"
        p = msg.sampling_params
        for name, sampled_ids in (
            ("logit_bias", p.logit_bias or ()),
            ("allowed_token_ids", p.allowed_token_ids or ()),
            ("bad_words_token_ids", [t for seq in p.bad_words_token_ids or () for t in seq]),
        ):
            if any(t >= self.vocab_size for t in sampled_ids):  # the sampler indexes logits by them
                return f"{name} must be token ids in [0, {self.vocab_size})"
        if msg.images:
            problem = self._check_images(msg)
            if problem is not None:
                return problem
        if msg.pooling_params is not None:
            return self._check_pooling(msg)
        if self.runner_kind == "pooling":
            return POOLING_ONLY
        if msg.max_tokens < 1 or len(ids) + msg.max_tokens > self.max_model_len:
            return (
                f"max_tokens: {len(ids)} prompt + {msg.max_tokens} new tokens exceed the context window of "
                f"{self.max_model_len}"
            )
        return None if msg.lora_request is None else self._check_lora(msg.lora_request)

    def _check_pooling(self, msg: EngineCoreRequest) -> str | None:
        """A pooling request computes its prompt and nothing after it; it samples nothing."""
        assert msg.pooling_params is not None  # asked only of pooling requests
        if len(msg.prompt_token_ids) > self.max_model_len:
            return (
                f"prompt: {len(msg.prompt_token_ids)} tokens exceed the context window of {self.max_model_len} "
                "(truncate_prompt_tokens cuts it)"
            )
        problem = self._check_task(msg.pooling_params)
        if problem is not None:
            return problem
        dims = msg.pooling_params.dimensions
        if dims is not None and dims > self.hidden_size:
            return f"dimensions: {dims} is more than the model's hidden size {self.hidden_size}"
        if msg.max_tokens != 1:
            return "max_tokens: a pooling request computes its prompt only (max_tokens 1)"
        return None if msg.lora_request is None else self._check_lora(msg.lora_request)

    def _check_images(self, msg: EngineCoreRequest) -> str | None:
        """Each image where the front end put it: whole image-token runs of its length, in order, inside
        the prompt, its pixels of the tower's size (Gemma 3) or of its patch grid (Qwen2.5-VL), and, where
        a chunk must hold an image whole (`SchedulerConfig.split_images` False), no longer than a step's
        token budget."""
        v = self.vision
        if v is None:
            return "images: this model does not accept image input"
        if self.tensor_parallel is not None:  # the other ranks' steps carry no images yet
            return "images: not supported with tensor parallelism yet"
        ids, end, budget = msg.prompt_token_ids, 0, self.scheduler_config.max_num_batched_tokens
        for image in msg.images:
            if image.length > budget and not self.scheduler_config.split_images:
                return f"images: an image's {image.length} tokens exceed max_num_batched_tokens ({budget})"
            if image.offset < end or image.end > len(ids):
                return "images: an image's tokens are out of order, overlap or leave the prompt"
            if any(t != v.image_token_id for t in ids[image.offset : image.end]):
                return f"images: an image's positions must hold image tokens ({v.image_token_id})"
            problem = _image_shape_problem(v, image)
            if problem is not None:
                return problem
            end = image.end
        return None

    def _check_task(self, params: PoolingParams) -> str | None:
        labels = 0 if self.encoder is None else self.encoder.num_labels
        problem = task_problem(params, self.encoder is not None, labels)
        if problem is not None or params.score_token_ids is None:
            return problem
        if any(t >= self.vocab_size for t in params.score_token_ids):
            return f"score_token_ids must be token ids in [0, {self.vocab_size})"
        if self.tensor_parallel is not None:
            return "score_token_ids: score requests are not supported with tensor parallelism"
        return None

    def _check_lora(self, lora: LoRARequest) -> str | None:
        """Why the adapter cannot run (None: it can, and its tensors are being read off this thread)."""
        if self.runner.lora is None:
            return "lora_request: LoRA is not enabled on this engine (enable_lora / --enable-lora)"
        try:
            self.runner.lora.check(lora)
        except ValueError as e:
            return str(e)
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        """End requests now and free their KV blocks; the front end already knows, so no output."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, RequestStatus.FINISHED_ABORTED)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish(req, status)
        del self.requests[req.request_id]
        self._num_host_sync -= req.needs_host_tokens

    def has_work(self) -> bool:
        return bool(self.requests or self._inflight or self._pending)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    # ---- stepping ---------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Launch the next step when there is room, and collect the oldest one in flight when it is due:
        with one step at a time that is the one just launched."""
        outputs, self._pending = self._pending, []
        depth = 2 if self.async_scheduling and not self._num_host_sync and not self._drafting() else 1
        launched = len(self._inflight) < depth and self._launch(outputs)
        if self._inflight and (len(self._inflight) >= depth or not launched):
            outputs += self._collect()
        return self.outputs(outputs)

    def _drafting(self) -> bool:
        """Speculation is on for the batch as it is: a step's drafts come from the tokens of the step
        before, so steps go one at a time. At a batch large enough to turn drafts off, async scheduling
        (when on) overlaps steps as without speculation; so it does while n-gram lookup finds nothing
        to draft, except every `NGRAM_PROBE_STEPS`-th step, which goes alone so that the lookup sees
        every token and can find drafts again."""
        spec = self.speculative
        if spec is None or self.scheduler.num_draft_tokens() == 0:
            return False
        if spec.needs_draft_model or self._num_steps % NGRAM_PROBE_STEPS == 0:
            return True
        # a step with drafts must be collected before the next is planned: its accepted count decides where
        # the request goes on
        return any(r.spec_token_ids for r in self.scheduler.running)

    def outputs(self, outputs: list[EngineCoreOutput] | None = None) -> EngineCoreOutputs:
        return EngineCoreOutputs(outputs or [], time.monotonic(), self.stats())

    def stats(self) -> SchedulerStats:
        bm, timer = self.block_manager, self.runner.timer
        return SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            num_requests_received=self._num_received,
            gpu_busy_s=timer.busy_s if timer else 0.0,
            gpu_idle_s=timer.idle_s if timer else 0.0,
            gpu_mask_wait_s=timer.mask_wait_s if timer else 0.0,
            num_requests=len(self.requests),
            num_encoded_images=self.runner.num_encoded_images,
            num_pinned_images=self.runner.num_pinned_images,
            spec_decode=self.spec_counts.message() if self.speculative else None,
        )

    def _launch(self, outputs: list[EngineCoreOutput]) -> bool:
        batch = self.scheduler.schedule()
        if not batch:
            return False
        if self.tensor_parallel is not None:
            self.tensor_parallel.check()
        try:
            pending = self.runner.launch(batch.step, functools.partial(self._start_masks, drafts=batch.drafts))
        except Exception as e:  # noqa: BLE001 - a failed launch fails its batch's requests; the engine keeps serving
            outputs += self._failed(batch, e)
            return True
        self.scheduler.advance(batch)
        self._inflight.append((batch, pending))
        return True

    def _start_masks(self, request_ids: list[str], drafts: dict[str, list[int]]) -> Future[torch.Tensor] | None:
        """The grammar masks of a step being launched: a row per sampling row, so a request verifying
        drafts gets its mask after each draft too (llguidance computes them and rolls back). Requests
        whose last token is still in flight (sampled by the step before, under async scheduling) get
        it fed to their matcher first, in the mask thread, once that step has finished; what feeding it
        gave is kept on the request."""
        requests = [self.requests[rid] for rid in request_ids]
        late = [(r, r.matcher) for r in requests if r.matcher is not None and r.num_inflight_tokens]
        previous = self._inflight[-1][1] if late else None

        def catch_up() -> None:
            assert previous is not None  # catch_up runs only when some request is late
            tokens = self.runner.sampled_tokens(previous, [req.request_id for req, _ in late])
            errors = self.grammar.consume_all([(matcher, token) for (_, matcher), token in zip(late, tokens)])
            for (req, _), error in zip(late, errors):
                req.num_grammar_tokens += 1
                req.grammar_error = error

        fill = self.grammar.start_masks(
            [r.matcher for r in requests], catch_up if late else None, [drafts[r.request_id] for r in requests]
        )
        if fill is None:
            return None
        self._grammar_fed = fill.fed
        return fill.bitmask

    def _collect(self) -> list[EngineCoreOutput]:
        batch, pending = self._inflight.popleft()
        try:
            result = self.runner.wait(pending)
        except Exception as e:  # noqa: BLE001 - a failed step fails its batch's requests; the engine keeps serving
            return self._failed(batch, e)
        self._num_steps += 1
        outputs = self._sampled_outputs(batch, result)
        for req in batch.requests:
            if not req.status.finished:
                self.scheduler.cache_full_blocks(req)
        return outputs

    def _sampled_outputs(self, batch: ScheduledBatch, result: StepResult) -> list[EngineCoreOutput]:
        # The batch's own requests: an id may belong to a newer request once its first one has ended.
        by_id = {req.request_id: req for req in batch.requests}
        outputs: dict[str, EngineCoreOutput] = {}
        for rid, (first, prompt_logprobs) in result.prompt_logprobs.items():
            req = by_id[rid]
            new = None if req.status.finished else _unsent_prompt_logprobs(req, first, prompt_logprobs)
            if new is not None:
                outputs[rid] = EngineCoreOutput(rid, [], new_prompt_logprobs=new)
        for rid, embedding in result.pooled.items():
            req = by_id[rid]
            req.num_inflight_tokens -= 1  # counted by `Scheduler.advance` as for a sampling request
            if not req.status.finished:
                out = outputs[rid] = EngineCoreOutput(rid, [], embedding=embedding)
                out.num_cached_tokens = max(req.num_cached_tokens, 0)
                self._end(req, RequestStatus.FINISHED_STOPPED, out)
        constrained: list[Request] = []
        for rid, tokens, logprobs in zip(result.request_ids, result.token_ids, result.logprobs):
            req = by_id[rid]
            req.num_inflight_tokens -= 1
            num_drafts = len(batch.drafts[rid])
            if num_drafts:
                self.spec_counts.add(num_drafts, len(tokens) - 1)
                self.scheduler.reject_drafts(req, num_drafts - (len(tokens) - 1))
            if req.status.finished:  # aborted, or finished by the step before, while this one ran
                continue
            out = outputs.setdefault(req.request_id, EngineCoreOutput(req.request_id, []))
            out.num_draft_tokens, out.num_accepted_tokens = num_drafts, len(tokens) - 1
            try:
                if self._append(req, tokens, logprobs, out) and req.matcher is not None:
                    constrained.append(req)
            except Exception as e:  # noqa: BLE001 - one request's bookkeeping failed: fail only that request
                outputs[req.request_id] = self._bookkeeping_failed(req, e)
        if constrained:
            self._check_grammars(constrained, outputs)
        if self.speculative is not None:
            self._propose([by_id[rid] for rid in result.request_ids], result)
        return list(outputs.values())

    def _append(self, req: Request, tokens: list[int], logprobs: Logprobs | None, out: EngineCoreOutput) -> bool:
        """Record the tokens up to the first that ends the request; False when one did."""
        status, kept = None, 0
        while status is None and kept < len(tokens):
            req.append_token(tokens[kept])
            status = req.check_stop(tokens[kept], self.max_model_len)
            kept += 1
        out.new_token_ids = tokens[:kept]
        out.new_logprobs = logprobs if logprobs is None or kept == len(tokens) else _first_rows(logprobs, kept)
        out.num_cached_tokens = max(req.num_cached_tokens, 0)
        if status is not None:
            self._end(req, status, out)
        return status is None

    def _propose(self, requests: list[Request], result: StepResult) -> None:
        """Drafts for the next step of each request that sampled: the runner's drafter proposed them, or the
        n-gram lookup does now; cut to what the request's grammar allows, and none when the batch is too
        large for drafts to pay."""
        assert self.speculative is not None  # called only with speculative decoding
        k = self.scheduler.num_draft_tokens()
        for req in requests:
            if req.status.finished:
                continue
            # a token still in flight (an overlapped step) would come between the tokens drafted from and the drafts
            n = 0 if req.num_inflight_tokens else min(k, req.max_drafts(self.max_model_len))
            if self.speculative.method == "ngram":
                s = self.speculative
                drafts = propose_ngram(req.all_token_ids, n, s.prompt_lookup_min, s.prompt_lookup_max)
            else:
                drafts = result.draft_token_ids.get(req.request_id, [])[:n]
            if req.matcher is not None and drafts:  # only what the grammar allows is worth verifying
                drafts = drafts[: req.matcher.validate_tokens(drafts)]
            req.spec_token_ids = drafts

    def _check_grammars(self, items: list[Request], outputs: dict[str, EngineCoreOutput]) -> None:
        """End the requests whose grammar cannot go on after their new tokens. A complete grammar allows
        only EOS next, so a request ends on EOS as any other does. Under async scheduling the mask thread
        feeds these tokens (`_start_masks`) while the core does the step's other bookkeeping, and then
        fills the next masks: so this waits for the feeding only now, and reads what it gave, never the
        matchers (the core feeds the ones it did not)."""
        if self._grammar_fed is not None:
            wait_futures([self._grammar_fed])
        for req in items:
            out = outputs[req.request_id]
            try:
                while req.num_grammar_tokens < req.num_output_tokens and req.grammar_error is None:
                    assert req.matcher is not None  # items holds only requests with a grammar
                    req.grammar_error = consume(req.matcher, req.output_token_ids[req.num_grammar_tokens])
                    req.num_grammar_tokens += 1
                if req.grammar_error is not None:
                    out.error = req.grammar_error
                    self._end(req, RequestStatus.FINISHED_ABORTED, out)
            except Exception as e:  # noqa: BLE001 - the grammar step of one request fails that request only
                outputs[req.request_id] = self._bookkeeping_failed(req, e)

    def _end(self, req: Request, status: RequestStatus, out: EngineCoreOutput) -> None:
        self._finish(req, status)
        out.finish_reason, out.stop_reason = status.value, req.stop_reason

    def _bookkeeping_failed(self, req: Request, error: Exception) -> EngineCoreOutput:
        """One request's bookkeeping failed: fail only that request."""
        logger.exception("request %s failed after its step", req.request_id)
        if not req.status.finished:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        return EngineCoreOutput(req.request_id, [], finish_reason="abort", error=f"{type(error).__name__}: {error}")

    def _failed(self, batch: ScheduledBatch, error: Exception) -> list[EngineCoreOutput]:
        """The model failed on this batch: fail its requests and keep serving the others, unless the
        tensor-parallel ranks may now be out of step, which ends the core."""
        if self.tensor_parallel is not None:
            raise self.tensor_parallel.step_failed(error) from error
        logger.exception("model step failed; aborting the %d requests in the batch", len(batch))
        message = f"{type(error).__name__}: {error}"
        outputs = []
        for req in batch.requests:
            if not req.status.finished:
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                outputs.append(EngineCoreOutput(req.request_id, [], finish_reason="abort", error=message))
        return outputs


def _first_rows(logprobs: Logprobs, n: int) -> Logprobs:
    return Logprobs(logprobs.token_ids[:n], logprobs.logprobs[:n], logprobs.ranks[:n])


def _unsent_prompt_logprobs(req: Request, first: int, logprobs: Logprobs) -> Logprobs | None:
    """The part of a step's prompt logprobs not reported before (a preempted request recomputes its
    prompt, and its earlier positions were sent already)."""
    skip = req.num_prompt_logprobs_sent - first
    if skip >= len(logprobs.ranks):
        return None
    req.num_prompt_logprobs_sent = first + len(logprobs.ranks)
    if skip <= 0:
        return logprobs
    return Logprobs(logprobs.token_ids[skip:], logprobs.logprobs[skip:], logprobs.ranks[skip:])


def _start_tensor_parallel(config: EngineConfig, model_config: ModelConfig) -> TensorParallelGroup | None:
    """The other ranks, started from the same config (they load their shards of the same files)."""
    if config.tensor_parallel_size == 1:
        return None
    check_divisible(model_config, config.tensor_parallel_size)
    group = TensorParallelGroup(config)
    atexit.register(group.stop)
    return group


def _vision_facts(v: VisionConfig | QwenVisionConfig) -> VisionFacts:
    if isinstance(v, QwenVisionConfig):
        ids = (v.image_token_id, v.vision_start_token_id, v.vision_end_token_id)
        return VisionFacts(0, 0, *ids, QWEN25_VL_FAMILY, v.patch_size, v.temporal_patch_size, v.spatial_merge_size)
    return VisionFacts(v.tokens_per_image, v.image_size, v.image_token_id, v.boi_token_id, v.eoi_token_id)


def _image_shape_problem(v: VisionConfig | QwenVisionConfig, image: ImageInput) -> str | None:
    """Why the image's token count or pixels do not fit the tower, or None."""
    if isinstance(v, VisionConfig):
        if image.length != v.tokens_per_image:
            return f"images: an image has {v.tokens_per_image} tokens, not {image.length}"
        if image.size != v.image_size or len(image.pixels) != 4 * 3 * v.image_size**2:
            return f"images: pixels must be float32 [3, {v.image_size}, {v.image_size}]"
        return None
    m = v.spatial_merge_size
    if image.grid is None or len(image.grid) != 3 or min(image.grid) < 1 or image.grid[1] % m or image.grid[2] % m:
        return f"images: a patch grid (t, h, w) with h and w multiples of {m} must come with each image"
    t, h, w = image.grid
    if image.length != t * h * w // m**2:
        return f"images: an image of patch grid {image.grid} has {t * h * w // m**2} tokens, not {image.length}"
    if len(image.pixels) != 4 * t * h * w * 3 * v.temporal_patch_size * v.patch_size**2:
        return f"images: pixels must be float32 [{t * h * w}, {3 * v.temporal_patch_size * v.patch_size**2}]"
    return None


def _prefix_caching(config: EngineConfig, cfg: ModelConfig) -> bool:
    """Whether the block manager caches prefixes: not for an encoder (its keys see later tokens), nor for a
    model with linear-attention layers, whose per-request recurrent state at a block boundary is not in
    the KV cache (a hit would skip tokens the state never saw)."""
    if not config.cache.enable_prefix_caching or cfg.encoder is not None:
        return False
    if cfg.linear_attention is not None:
        logger.info(
            "prefix caching disabled: %s keeps a recurrent state per request in its linear-attention layers, "
            "which the KV cache's blocks do not hold",
            cfg.architecture,
        )
        return False
    return True


def _check_linear_attention(config: EngineConfig, cfg: ModelConfig) -> None:
    """What a model with linear-attention layers (Qwen3-Next) cannot run with yet, refused by name: its
    recurrent state advances one token per step and has no rollback for rejected drafts, and its state
    pool is not split over ranks."""
    if cfg.linear_attention is None:
        return
    if config.speculative is not None:
        raise ValueError(f"speculative decoding is not supported for {cfg.architecture} (linear-attention layers)")
    if config.tensor_parallel_size > 1:
        raise ValueError(f"tensor parallelism is not supported for {cfg.architecture} (linear-attention layers)")


def _shared_window(cfg: ModelConfig) -> int | None:
    """The window every layer attends through, or None: only then do a request's blocks leave all
    layers' windows, so that the block manager may release them before the request ends."""
    windows = {cfg.layer_window(layer) for layer in range(cfg.num_hidden_layers)}
    return windows.pop() if len(windows) == 1 else None


def _resolve_async_scheduling(requested: bool | None, tensor_parallel_size: int, device_type: str) -> bool:
    """On by default with one CUDA GPU, where it hides the host's per-step work behind the GPU's; on the
    CPU the same cores do both, so nothing is hidden. The tensor-parallel step broadcast sends token
    ids from the host, so it needs them there: one step at a time. (Speculative decoding steps one at a
    time while it drafts: `_drafting`.)"""
    if requested is None:
        return device_type == "cuda" and tensor_parallel_size == 1
    if requested and tensor_parallel_size > 1:
        raise ValueError("async_scheduling: not supported with tensor parallelism (tensor_parallel_size > 1)")
    return requested
