"""Owns the model and its KV cache on one device; turns a step description into sampled tokens.

A step is launched (`launch`: inputs flattened into one varlen batch and copied, forward, sampling,
results copied back without waiting) and later collected (`wait`). On a GPU the host can so
prepare the next step while this one runs; on the CPU `launch` computes everything at once. A step
with grammar masks is left open until they are in: its sampling is queued by the next `launch`,
after that one has prepared its inputs, or by `wait`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ember import timeline
from ember.config import (
    NO_MMPROJ,
    CacheConfig,
    LoadConfig,
    LoRAConfig,
    RunnerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from ember.distributed import host_group, tp_size
from ember.messages import Logprobs
from ember.model.bert import EncoderModel
from ember.model.eagle3 import load_eagle3
from ember.model.hf_config import ModelConfig, QwenVisionConfig
from ember.model.linear import QuantEmbedding, QuantLinear
from ember.model.llama import CausalLM, ImageRows
from ember.model.loader import ModelFiles, load_model_files
from ember.model.moe import FusedExperts
from ember.model.qwen3_next import Qwen3NextForCausalLM
from ember.model.registry import Model
from ember.ops.attention import AttentionMetadata
from ember.quant.formats import FP8_DTYPE
from ember.runner.cuda_graph import StepGraphs, capture_sizes, prefill_capture_sizes
from ember.runner.drafter import DraftModelDrafter, DraftStep, Eagle3Drafter
from ember.runner.images import StepImages
from ember.runner.input_buffers import InputBuffers
from ember.runner.kv_cache import CachedAttention, KVCache
from ember.runner.linear_state import LinearStatePool
from ember.runner.lora_manager import LoRAManager
from ember.runner.model_build import build_model
from ember.runner.pooler import pool_step
from ember.runner.request_state import RequestState, RequestStates
from ember.runner.step import StepDescription, StepResult
from ember.runner.step_broadcast import StepHeader, receive_step, send_step
from ember.runner.step_inputs import GraphKey, PreparedStep, PromptRows, graph_key, prepare_step
from ember.runner.step_timer import StepTimer
from ember.runner.warmup import warm_up_batches
from ember.sampling.rejection import DraftRows, Verified, verify, verify_greedy
from ember.sampling.sampler import Sampler, SamplerOutput, SamplingBatch, Scores, gather_logprobs
from ember.transfer import to_device, to_host

logger = logging.getLogger("ember")
_DEFAULT_CPU_KV_BYTES = 4 << 30
_PROMPT_LOGPROB_ROWS = 512  # prompt positions per [rows, vocab] logits slice


@dataclass
class _Unsampled:
    """An open step's sampling: queued once the grammar masks being filled for it are in."""

    masks: Future[torch.Tensor]
    logits: torch.Tensor
    scores: Scores | None  # sampling up to the masks, done already (no row filters by probability, no one pass)
    sampling: SamplingBatch
    start: torch.cuda.Event | None
    forward_end: torch.cuda.Event | None


@dataclass
class PendingStep:
    """A launched step: its results are on their way from the device to the host."""

    requests: list[RequestState]  # the requests that sample a token, in row order
    prompt_logprobs: list[tuple[PromptRows, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    sampled: torch.Tensor | None = None  # [N] int64 on the host (pinned on CUDA); [N, K + 1] with drafts
    num_sampled: torch.Tensor | None = None  # [N] int64 on the host: tokens per request, set with drafts
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # ids, values, ranks on the host
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # start, end of its device work (CUDA)
    mask_wait: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # forward's end, masks' arrival (CUDA)
    unsampled: _Unsampled | None = None  # set while the step is open (its sampling not queued yet)
    error: Exception | None = None  # its sampling failed; `wait` raises it
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # the draft model's proposals
    # pooling requests whose prompt ended in the step: (id, length) each, and their vectors on the host
    pooled: tuple[list[tuple[str, int]], torch.Tensor] | None = None


@dataclass
class _StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    graph: GraphKey | None  # the CUDA graph to replay, or None for an eager forward
    # each token's LoRA slot when an adapter of the step adapts the LM head (else None: no head delta)
    lora_slots: torch.Tensor | None = None
    token_types: torch.Tensor | None = None  # an encoder's token types (None: every token type 0)
    images: ImageRows | None = None  # the step's image-token rows and their embeddings
    mrope_positions: torch.Tensor | None = None  # M-RoPE models: each token's [3, T] positions

    @property
    def rope_positions(self) -> torch.Tensor:
        """The positions the model's rotary reads: M-RoPE's where the model has them."""
        return self.positions if self.mrope_positions is None else self.mrope_positions


@dataclass
class _Prepared:
    """A step's inputs, uploaded, before anything that needs the step before it."""

    inputs: _StepInputs
    step: PreparedStep
    sampling: SamplingBatch | None  # None when no row samples
    num_speculative_tokens: int  # drafts the draft model proposes for the next step


def _prompt_logit_slices(n: int) -> list[tuple[int, int]]:
    """Row ranges of one request's prompt logprobs, each bounding a [rows, vocab] logits tensor."""
    return [(lo, min(n, lo + _PROMPT_LOGPROB_ROWS)) for lo in range(0, n, _PROMPT_LOGPROB_ROWS)]


class ModelRunner:
    """One rank's model and KV cache. Rank 0 (the engine's) keeps the requests' state from the scheduler's
    step descriptions, builds each step from them and, under tensor parallelism, broadcasts its inputs;
    other ranks `serve_steps`, mirroring every forward and logits computation so the collectives inside
    them line up."""

    def __init__(
        self,
        files: ModelFiles,
        config: RunnerConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device,
        speculative: SpeculativeConfig | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        timeline.mark("model files read")
        if device.type == "cuda":  # the CUDA context: made here, not inside the first allocation, for the timeline
            torch.cuda.synchronize(device)
            timeline.mark("CUDA initialized")
        self.device = device
        self.dtype: torch.dtype = getattr(torch, config.dtype)
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.model_config = cfg = files.model_config.for_max_model_len(scheduler_config.max_model_len)
        self.block_size = cache_config.block_size
        torch.manual_seed(config.seed)
        self.model: Model = build_model(files, cfg, scheduler_config.max_model_len, self.dtype, device, config.seed)
        timeline.mark("model loaded")
        self.quantization = files.quantization
        self.kv_dtype = FP8_DTYPE if config.kv_cache_dtype != "auto" else self.dtype
        if cfg.mla is not None:  # one latent row per token and layer (ember/model/mla.py)
            self.kv_cache = KVCache(
                self.model.attention_layers(), 1, cfg.mla.cache_dim, self.block_size, self.kv_dtype, device, latent=True
            )
        else:
            self.kv_cache = self._kv(self.model.attention_layers(), self.model.layout.num_kv_heads, cfg.head_dim)
        self.linear_state = self._linear_state(cfg, scheduler_config.max_num_seqs)
        self.sampler = Sampler()
        self.drafter = self._drafter(speculative, config) if speculative is not None else None
        self.enforce_eager = config.enforce_eager
        max_blocks = -(-scheduler_config.max_model_len // self.block_size)
        # a draft token is a query of its own (ember/runner/step_inputs.py): a step's drafts add rows
        drafts = 0 if speculative is None else speculative.draft_budget_for(device.type)
        self.buffers = InputBuffers(
            max(scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs),
            scheduler_config.max_num_seqs + min(drafts, scheduler_config.max_num_batched_tokens),
            max_blocks,
            self.device,
            lora=lora is not None,
            token_types=cfg.encoder is not None and cfg.encoder.type_vocab_size > 1,
            mrope=cfg.mrope_section is not None,
            state_slots=self.linear_state is not None,
        )
        lora_slots = self.buffers.lora_slots
        self.lora = None if lora is None or lora_slots is None else LoRAManager(self._lm, lora, lora_slots.dev)
        self.graphs: StepGraphs | None = None
        self.timer = StepTimer() if self.device.type == "cuda" else None
        self.requests = RequestStates(self.device, None if self.linear_state is None else self.linear_state.slots)
        self.pooler = config.pooler
        vision = isinstance(self.model, CausalLM) and self.model.vision is not None
        self.images = StepImages(self._lm, device) if vision else None
        # The last launched step's sampled ids on the device, and each sampling request's row in them.
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self._open: PendingStep | None = None  # the launched step whose sampling waits for its masks
        self._last_sampling: tuple[tuple[RequestState, ...], SamplingBatch] | None = None  # see _sampling_batch

    @property
    def _mrope_merge(self) -> int | None:
        """An M-RoPE model's spatial merge size (its image tokens' grid is the patch grid / this); None: 1D rotary."""
        v = self.model_config.vision
        if self.model_config.mrope_section is None:
            return None
        return v.spatial_merge_size if isinstance(v, QwenVisionConfig) else 1

    @property
    def num_encoded_images(self) -> int:
        return 0 if self.images is None else self.images.num_encoded

    @property
    def num_pinned_images(self) -> int:
        return 0 if self.images is None else self.images.num_pinned

    @property
    def _lm(self) -> CausalLM:
        """The model as a generator, for every sampling path: an encoder's engine admits pooling requests only
        (EngineCore refuses the rest), so these paths never meet one."""
        assert isinstance(self.model, CausalLM), "an encoder model samples nothing"
        return self.model

    def _drafter(self, spec: SpeculativeConfig, config: RunnerConfig) -> DraftModelDrafter | Eagle3Drafter | None:
        """The draft model or EAGLE-3 head (None for n-gram lookup), in the target's dtype, with KV in the
        same dtype and block size; random weights when the target has them (`--load-format dummy`)."""
        if spec.model is None:
            return None
        dummy = config.load_format == "dummy"
        max_len = self.scheduler_config.max_model_len
        if spec.method == "eagle3":
            head = load_eagle3(spec.model, self.model_config, self.device, self.dtype, max_len, random_weights=dummy)
            head.share_embedding(self._lm.model.embed_tokens)
            self._lm.set_aux_hidden_state_layers(head.aux_hidden_state_layers)
            layout, head_dim = head.layout, head.config.model.head_dim
            return Eagle3Drafter(
                head, self._kv(head.attention_layers(), layout.num_kv_heads, head_dim), self.block_size, self.device
            )
        files = load_model_files(LoadConfig(spec.model, None, config.load_format, None, mmproj=NO_MMPROJ))
        if files.model_config.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft model's vocabulary ({files.model_config.vocab_size} tokens) "
                f"differs from the target's ({self.model_config.vocab_size})"
            )
        cfg = files.model_config.for_max_model_len(max_len)
        model = build_model(files, cfg, max_len, self.dtype, self.device, config.seed)
        if not isinstance(model, CausalLM):
            raise ValueError(f"speculative_config.model: {spec.model} is an encoder; a draft model must generate")
        kv = self._kv(model.attention_layers(), model.layout.num_kv_heads, cfg.head_dim)
        return DraftModelDrafter(model, kv, self.block_size, self.device)

    def _linear_state(self, cfg: ModelConfig, max_num_seqs: int) -> LinearStatePool | None:
        """The state pool of a model with linear-attention layers (Qwen3-Next): a slot per running sequence."""
        if cfg.linear_attention is None or not isinstance(self.model, Qwen3NextForCausalLM):
            return None
        layers = self.model.linear_attention_layers()
        return LinearStatePool(layers, cfg.linear_attention, max_num_seqs, self.dtype, self.device)

    def _kv(self, layers: Sequence[CachedAttention], num_kv_heads: int, head_dim: int) -> KVCache:
        return KVCache(layers, num_kv_heads, head_dim, self.block_size, self.kv_dtype, self.device)

    # ---- KV cache -------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        """A block's bytes in every model that keeps KV for it: the target's and a draft model's."""
        draft = self.drafter.kv_cache.bytes_per_block if self.drafter is not None else 0
        return self.kv_cache.bytes_per_block + draft

    def prepare_cache(self) -> int:
        """Size, allocate and capture: every rank runs this same sequence (its collectives must pair up)."""
        num_blocks = self.determine_num_blocks()
        self.kv_cache.allocate(num_blocks)
        if self.drafter is not None:
            self.drafter.kv_cache.allocate(num_blocks)
        timeline.mark("KV allocated")
        self.capture_cuda_graphs()
        return num_blocks

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Compile the kernel variants of mixed prefill/decode steps now (see runner/warmup.py). Rank 0
        runs it once every rank serves steps; it leaves no trace in the step timer."""
        if self.device.type != "cuda" or isinstance(self.model, EncoderModel):  # an encoder never decodes
            return
        sc = self.scheduler_config
        for step in warm_up_batches(
            self.block_size, self.kv_cache.num_blocks, sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len
        ):
            self.wait(self.launch(step))
            if self.linear_state is not None:  # its batches reuse ids without finishing them: free every slot
                self.requests.clear()
        self._last_sampled = None
        self.requests.clear()
        self.timer = StepTimer()
        timeline.mark("kernels warmed up")

    def determine_num_blocks(self) -> int:
        """`--kv-cache-memory` when given; else on GPU what `--gpu-memory-utilization` leaves after a forward
        at the largest batch, and on CPU a fixed 4 GiB."""
        cap = self.scheduler_config.max_num_seqs * -(-self.scheduler_config.max_model_len // self.block_size)
        if self.cache_config.kv_cache_memory_bytes is not None:
            budget: float = self.cache_config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            peak = self._profile_peak_memory()
            timeline.mark("memory profiled")
            budget = total * self.cache_config.gpu_memory_utilization - (total - free) - peak
            logger.info(
                "GPU memory: total %.1f GiB, in use %.2f GiB, activation peak %.2f GiB",
                total / 2**30,
                (total - free) / 2**30,
                peak / 2**30,
            )
        else:
            budget = _DEFAULT_CPU_KV_BYTES
        num_blocks = min(int(budget // self.bytes_per_block), cap)
        if tp_size() > 1:  # every rank's pool holds the same blocks: the smallest budget decides
            agreed = torch.tensor([num_blocks], dtype=torch.int64)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=host_group())
            num_blocks = int(agreed.item())
        if num_blocks < 1:
            raise ValueError(
                "not enough memory for a single KV cache block: raise --gpu-memory-utilization or --kv-cache-memory"
            )
        return num_blocks

    def _profile_peak_memory(self) -> int:
        """Extra GPU memory a forward + logits pass at the full token budget needs beyond what is allocated now."""
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = self.scheduler_config.max_num_batched_tokens
        max_len = self.scheduler_config.max_model_len
        lens = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
        blocks = [-(-n // self.block_size) for n in lens]
        self.kv_cache.allocate(sum(blocks))
        tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
        first = 0
        for row, nb in enumerate(blocks):
            tables[row, :nb] = torch.arange(first, first + nb)
            first += nb
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.cat(
                [
                    tables[r, : blocks[r]].repeat_interleave(self.block_size)[:n] * self.block_size
                    + torch.arange(n) % self.block_size
                    for r, n in enumerate(lens)
                ]
            ).to(dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            num_decodes=0,
            max_query_len=max(lens),
            max_seq_len=max(lens),
            seq_lens_host=lens,
            query_start_host=starts,
            state_slots=None
            if self.linear_state is None
            else torch.arange(len(lens), device=dev) % self.linear_state.slots.num_slots,
            state_fresh=None if self.linear_state is None else torch.ones(len(lens), dtype=torch.bool, device=dev),
        )
        ids = torch.zeros(tokens, dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        with torch.inference_mode():
            hidden = self.model(ids, positions, meta)
            if isinstance(self.model, CausalLM):
                self.model.compute_logits(hidden[: min(self.scheduler_config.max_num_seqs, tokens)])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        self.kv_cache.release()
        torch.cuda.empty_cache()
        return peak

    @property
    def weight_bytes(self) -> int:
        """Bytes of every parameter plus the codes, scales and zeros of quantized layers (a tied
        embedding and LM head counted once)."""
        tensors: dict[int, torch.Tensor] = {id(p): p for p in self.model.parameters()}
        for module in self.model.modules():
            if isinstance(module, (QuantLinear, QuantEmbedding, FusedExperts)):
                tensors.update((id(t), t) for t in module.weight_tensors())
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def capture_cuda_graphs(self) -> None:
        """Not for an encoder: its steps are whole prompts side by side, which run eagerly anyway. With LoRA
        on, each size twice: with the LoRA kernels and without (ember/runner/cuda_graph.py)."""
        if self.device.type != "cuda" or self.enforce_eager or isinstance(self.model, EncoderModel):
            return
        if self.linear_state is not None:
            logger.info(
                "CUDA graphs off: the linear-attention layers' PyTorch path reads the step's lengths on the host"
            )
            return
        before = torch.cuda.memory_reserved(self.device)
        with torch.inference_mode():
            sc = self.scheduler_config
            self.graphs = StepGraphs(
                self.model,
                self.buffers,
                sc.max_model_len,
                capture_sizes(sc.max_num_seqs),
                # MLA's prefill chunks run PyTorch ops over host lengths (ember/ops/mla.py): eagerly
                [] if self.model_config.mla else prefill_capture_sizes(sc.max_num_batched_tokens, sc.max_model_len),
                None if self.lora is None else self.lora.capturing,
            )
        timeline.mark("CUDA graphs captured")
        logger.info("CUDA graph memory: %.2f GiB", (torch.cuda.memory_reserved(self.device) - before) / 2**30)

    # ---- one step -------------------------------------------------------------------------

    def _upload(self, h: StepHeader, images: tuple[ImageRows, np.ndarray | None] | None = None) -> _StepInputs:
        """Device tensors (and host lists for the PyTorch attention path) from the filled host buffers."""
        b = self.buffers
        tokens, rows = h.tokens, h.rows
        meta = AttentionMetadata(
            slot_mapping=b.slot_mapping.upload(tokens)[: h.num_tokens],
            block_tables=b.block_tables.upload(rows)[: h.num_seqs],
            seq_lens=b.seq_lens.upload(rows)[: h.num_seqs],
            query_start_loc=b.query_start_loc.upload(h.num_seqs + 1),
            num_decodes=h.num_decodes,
            max_query_len=h.max_query_len,
            max_seq_len=h.max_seq_len,
            seq_lens_host=b.seq_lens.np[: h.num_seqs].tolist(),
            query_start_host=b.query_start_loc.np[: h.num_seqs + 1].tolist(),
            query_limits=None
            if images is None or images[1] is None
            else torch.from_numpy(images[1]).to(self.device, non_blocking=True),
            state_slots=None if b.state_slots is None else b.state_slots.upload(rows)[: h.num_seqs],
            state_fresh=None if b.state_fresh is None else b.state_fresh.upload(rows)[: h.num_seqs],
        )
        lora_slots = None
        if b.lora_slots is not None:
            lora_slots = b.lora_slots.upload(tokens)  # read in place by the LoRA layers (ember/model/lora.py)
        return _StepInputs(
            b.input_ids.upload(tokens)[: h.num_tokens],
            b.positions.upload(tokens)[: h.num_tokens],
            meta,
            b.logits_indices.upload(h.num_sample),
            graph_key(h),
            lora_slots if self.lora is not None and self.lora.head_active else None,
            None if b.token_types is None else b.token_types.upload(tokens)[: h.num_tokens],
            None if images is None else images[0],
            None if b.mrope_positions is None else b.mrope_positions.upload(tokens)[: h.num_tokens].t(),
        )

    def _forward(self, inputs: _StepInputs) -> torch.Tensor:
        if inputs.graph is not None:
            assert self.graphs is not None  # a step is padded only to a captured graph's size
            return self.graphs.replay(inputs.graph)
        if isinstance(self.model, EncoderModel):
            return self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs.token_types)
        return self.model(inputs.input_ids, inputs.rope_positions, inputs.meta, inputs.images)

    @torch.inference_mode()
    def launch(
        self, step: StepDescription, start_masks: Callable[[list[str]], Future[torch.Tensor] | None] | None = None
    ) -> PendingStep:
        """Start a step: every device operation is queued, nothing waits for the device. `start_masks`
        starts filling the grammar bitmask of the sampling rows (their request ids, in row order); it runs while
        the forward is queued and computed. A step with masks is left open: its sampling waits for
        them, and is queued by the next `launch` once that one has prepared its own inputs (or by
        `wait`). So the host's work for the next step overlaps the mask fill instead of following it:
        at 256 JSON-schema requests on the H200 the GPU otherwise idled ~0.7 ms of a 3.4 ms step
        while the host prepared the next one after the masks came."""
        prepared = self._prepare(step)
        if self._open is not None:
            self._close(self._open)
        return self._start(prepared, start_masks)

    def _prepare(self, description: StepDescription) -> _Prepared:
        """The requests' state updated, the step's inputs on the host and their copies queued: nothing
        here needs the step before."""
        requests = self.requests.update(description)
        if self.images is not None:
            self.images.release(description.preempted_request_ids + description.finished_request_ids)
        self.buffers.next_set()
        with_images = self.images is not None and self.images.in_step(requests, description.num_new_tokens)
        step = prepare_step(
            requests,
            description.num_new_tokens,
            self.buffers,
            self.block_size,
            self.graphs.sizes if self.graphs is not None and not with_images else None,
            self._lora_slots(requests),
            self._mrope_merge,
        )
        if tp_size() > 1:
            send_step(step.header, self.buffers)
        # Built before the forward so that its host-to-device copies overlap the GPU's work.
        sampling = self._sampling_batch(step.samplers) if step.samplers else None
        images = None
        if with_images:
            assert self.images is not None  # with_images says so
            images = self.images.rows(step.spans, self.buffers.positions.np[: step.header.num_tokens])
        return _Prepared(self._upload(step.header, images), step, sampling, description.num_speculative_tokens)

    def _lora_slots(self, requests: list[RequestState]) -> dict[int, int] | None:
        """The step's adapters put in device slots (read from disk first where needed), by lora_int_id."""
        if self.lora is None:
            return None
        return self.lora.activate(r.lora_request.lora_int_id for r in requests if r.lora_request is not None)

    def _start(
        self, prepared: _Prepared, start_masks: Callable[[list[str]], Future[torch.Tensor] | None] | None
    ) -> PendingStep:
        inputs, step, sampling = prepared.inputs, prepared.step, prepared.sampling
        start = StepTimer.record() if self.timer is not None else None
        if step.inflight_rows:
            self._fill_inflight_tokens(inputs.input_ids, step.inflight_rows)
        masks = None
        if start_masks and step.samplers:
            masks = start_masks([r.request_id for r in step.samplers])
        try:
            hidden = self._forward(inputs)
            prompt = [
                (rows, to_host(ids), to_host(values), to_host(ranks))
                for rows in step.prompt_rows
                for ids, values, ranks in [self._prompt_logprobs(rows, hidden, inputs.lora_slots)]
            ]
            pending = PendingStep(step.samplers, prompt_logprobs=prompt)
            pooled_ids, pooled = pool_step(self.pooler, step.spans, hidden, self.model)
            if pooled is not None:
                pending.pooled = (pooled_ids, to_host(pooled))
            if sampling is None:
                if self.drafter is not None and prepared.num_speculative_tokens:  # prompt chunks: the draft's KV
                    self.drafter.prefill(self._draft_step(prepared, None))
                self._last_sampled = None
                pending.events = self._end_events(start)
                return pending
            proposing = self.drafter is not None and prepared.num_speculative_tokens > 0
            if proposing or any(r.spec_token_ids for r in step.samplers):
                verified = self._verify(hidden[inputs.logits_indices], sampling, step.samplers, masks)
                self._verified(pending, verified)
                if proposing:
                    pending.draft_token_ids = self._propose(prepared, verified[0])
                pending.events = self._end_events(start)
                return pending
            # the sampled rows' LoRA slots, picked as their hidden rows are (None: no LM-head adapter)
            head_slots = None if inputs.lora_slots is None else inputs.lora_slots[inputs.logits_indices]
            if masks is None:
                self._sampled(pending, self._sample(hidden[inputs.logits_indices], sampling, head_slots), start)
                return pending
            # A masked step samples from the full logits: queue them, and what sampling can do before the
            # masks, now.
            logits = self._lm.head_logits(hidden[inputs.logits_indices], head_slots)
            # one pass on the GPU after the mask (Sampler.__call__) beats scoring before it
            early = sampling.mask_can_wait and not (logits.is_cuda and sampling.one_pass)
            scores = self.sampler.score(logits, sampling) if early else None
            forward_end = StepTimer.record() if start is not None else None
        except BaseException:
            if masks is not None:
                wait_futures([masks])  # the mask thread must be done with the matchers before anyone else
            raise
        pending.unsampled = _Unsampled(masks, logits, scores, sampling, start, forward_end)
        self._open = pending
        return pending

    def _draft_step(self, prepared: _Prepared, verified: Verified | None) -> DraftStep:
        """What the drafter reads of the step just run (the target's features: a replayed graph's own)."""
        inputs, step = prepared.inputs, prepared.step
        aux = self._lm.aux_hidden_states
        if inputs.graph is not None and self.graphs is not None:
            aux = self.graphs.aux_hidden_states.get(inputs.graph)
        num_tokens = inputs.input_ids.shape[0]
        aux = aux[:num_tokens] if aux is not None else None
        return DraftStep(inputs.input_ids, inputs.positions, inputs.meta, step.spans, step.samplers, verified, aux)

    def _propose(self, prepared: _Prepared, verified: Verified) -> dict[str, list[int]]:
        """The drafter's proposals for the next step, after its KV caught up with this one's tokens. Reads
        the emitted-token counts back to the host (a step with drafts is never overlapped)."""
        assert self.drafter is not None  # proposals are asked only with a drafter model
        reqs = prepared.step.samplers
        drafts = self.drafter.propose(self._draft_step(prepared, verified), prepared.num_speculative_tokens)
        return {r.request_id: d for r, d in zip(reqs, drafts)}

    def _verify(
        self,
        rows: torch.Tensor,
        sbatch: SamplingBatch,
        reqs: list[RequestState],
        masks: Future[torch.Tensor] | None,
    ) -> tuple[Verified, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """Accept each request's drafts the target agrees with (ember/sampling/rejection.py), and the
        logprobs of the tokens it emits, a row each. Grammar masks come a row per sampling row (the
        mask after each draft too)."""
        if masks is not None:
            sbatch.token_bitmask = masks.result().to(self.device)
        draft_rows = DraftRows.build([r.spec_token_ids for r in reqs], self.device)
        if sbatch.argmax_only:  # the drafts' rows need only the model's choice, not every logit
            return verify_greedy(self._lm.greedy_tokens(rows), draft_rows), None
        scores = self.sampler.target(self._lm.compute_logits(rows), sbatch)
        greedy = to_device([r.sampling_params.is_greedy for r in reqs], torch.bool, self.device)
        generators = {i: r.generator for i, r in enumerate(reqs) if r.generator is not None}
        verified = verify(scores.values, greedy, draft_rows, generators)
        if scores.raw_logprobs is None:
            return verified, None
        assert sbatch.max_num_logprobs is not None  # raw logprobs are computed only then
        emitted = verified.token_ids.clamp(min=0).flatten()
        return verified, gather_logprobs(
            scores.raw_logprobs[draft_rows.row_index.flatten()], emitted, sbatch.max_num_logprobs
        )

    def _verified(
        self, pending: PendingStep, out: tuple[Verified, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]
    ) -> None:
        """Queue the copies of a verified step's tokens to the host. A step launched before they arrive
        (async scheduling) takes each request's last emitted token on the device, as after plain sampling;
        the core plans such a step only for requests that verified no drafts."""
        verified, logprobs = out
        self._last_sampled = (verified.last_tokens(), {r.request_id: i for i, r in enumerate(pending.requests)})
        pending.sampled, pending.num_sampled = to_host(verified.token_ids), to_host(verified.num_tokens)
        if logprobs is not None:
            ids, values, ranks = logprobs
            pending.logprobs = (to_host(ids), to_host(values), to_host(ranks))

    def _sample(self, rows: torch.Tensor, sbatch: SamplingBatch, lora_slots: torch.Tensor | None) -> SamplerOutput:
        """Sample the rows' next tokens from their final hidden states (`lora_slots`: the rows' LoRA slots,
        given when an adapter of the step adapts the LM head)."""
        if sbatch.argmax_only:
            return SamplerOutput(self._lm.greedy_tokens(rows, lora_slots), None, None)
        return self.sampler(self._lm.head_logits(rows, lora_slots), sbatch)

    @torch.inference_mode()
    def _close(self, pending: PendingStep) -> None:
        """Queue an open step's sampling once its masks are in. A failure is the step's: `wait` raises it."""
        self._open, u = None, pending.unsampled
        assert u is not None  # an open step keeps its sampling until it is closed
        pending.unsampled = None
        try:
            u.sampling.token_bitmask = u.masks.result().to(self.device, non_blocking=True)  # pinned on CUDA hosts
            mask_wait = (u.forward_end, StepTimer.record()) if u.forward_end is not None else None
            # without early scores (a row filters by probability, or one pass), all of sampling follows the mask
            out = self.sampler(u.logits, u.sampling) if u.scores is None else self.sampler.pick(u.scores, u.sampling)
        except Exception as e:  # noqa: BLE001 - kept on the step and raised by wait(), in the core's thread
            pending.error = e
            self._last_sampled = None
            return
        self._sampled(pending, out, u.start, mask_wait)

    def _sampled(
        self,
        pending: PendingStep,
        out: SamplerOutput,
        start: torch.cuda.Event | None,
        mask_wait: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
    ) -> None:
        """Queue the copies of a step's samples to the host."""
        self._last_sampled = (out.sampled_token_ids, {r.request_id: i for i, r in enumerate(pending.requests)})
        pending.sampled = to_host(out.sampled_token_ids)
        if out.logprobs is not None:
            assert out.logprob_token_ids is not None and out.sampled_ranks is not None  # the sampler sets all three
            pending.logprobs = (to_host(out.logprob_token_ids), to_host(out.logprobs), to_host(out.sampled_ranks))
        pending.events, pending.mask_wait = self._end_events(start), mask_wait

    def _sampling_batch(self, reqs: list[RequestState]) -> SamplingBatch:
        """The rows' sampling tensors. A step sampling the same requests in the same order as the step
        before reuses that step's tensors, unless a row has state that changes every step (penalties,
        min_tokens still holding EOS back, bad words of several tokens: `SamplingBatch.reusable`):
        building them is a pinned copy per per-row tensor, ~0.3 ms of the core thread per step at 256
        rows on the H200 host (py-spy, 256 JSON-schema requests)."""
        if any(r.spec_token_ids for r in reqs):
            return self._draft_sampling_batch(reqs)
        rows = tuple(reqs)
        if self._last_sampling is not None and self._last_sampling[0] == rows:
            return replace(self._last_sampling[1], token_bitmask=None)
        batch = SamplingBatch.build(
            params=[r.sampling_params for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            num_output_tokens=[r.num_output_tokens for r in reqs],
            generators=[r.generator for r in reqs],
            eos_token_ids=[r.eos_token_ids for r in reqs],
            vocab_size=self.model_config.vocab_size,
            device=self.device,
        )
        self._last_sampling = (rows, batch) if batch.reusable else None
        return batch

    def _draft_sampling_batch(self, reqs: list[RequestState]) -> SamplingBatch:
        """A row per draft position: row j of a request sees its output plus its first j drafts (penalties,
        min_tokens and bad words count them). Verification draws from the requests' generators itself."""
        rows = [(r, j) for r in reqs for j in range(len(r.spec_token_ids) + 1)]
        self._last_sampling = None
        return SamplingBatch.build(
            params=[r.sampling_params for r, _ in rows],
            prompt_token_ids=[r.prompt_token_ids for r, _ in rows],
            output_token_ids=[r.output_token_ids + r.spec_token_ids[:j] for r, j in rows],
            num_output_tokens=[r.num_output_tokens + j for r, j in rows],
            generators=[None] * len(rows),
            eos_token_ids=[r.eos_token_ids for r, _ in rows],
            vocab_size=self.model_config.vocab_size,
            device=self.device,
        )

    @staticmethod
    def _end_events(start: torch.cuda.Event | None) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """The step's start event and one recorded now, after its last device work (the copies back)."""
        return None if start is None else (start, StepTimer.record())

    def _fill_inflight_tokens(self, input_ids: torch.Tensor, rows: list[tuple[int, RequestState]]) -> None:
        """Input tokens sampled by the previous step, still on the device: copied there, never to the host."""
        if self._last_sampled is None:
            raise RuntimeError(
                "a step needs tokens in flight, but the step before sampled none (none was "
                "launched, or its sampling failed)"
            )
        sampled, row_of = self._last_sampled
        try:
            src = [row_of[req.request_id] for _, req in rows]
        except KeyError:
            raise RuntimeError("a step needs a token that the previous step did not sample") from None
        dst = [t for t, _ in rows]
        if src == dst == list(range(len(rows))):  # a decode batch of the same requests in the same order
            input_ids[: len(rows)] = sampled[: len(rows)]
            return
        input_ids[to_device(dst, torch.int64, self.device)] = sampled[to_device(src, torch.int64, self.device)]

    @staticmethod
    def sampled_tokens(pending: PendingStep, request_ids: list[str]) -> list[int]:
        """What a launched step sampled for some of its requests (by id), once its device work is done
        (waits for that step only, not for any launched after it; `wait` still collects it as usual)."""
        if pending.error is not None:
            raise pending.error
        if pending.events is not None:
            pending.events[1].synchronize()
        row = {r.request_id: i for i, r in enumerate(pending.requests)}
        assert pending.sampled is not None  # asked only of a step that sampled these requests
        sampled = pending.sampled.tolist()  # one conversion, not a tensor index per request (256 of them)
        return [sampled[row[r]] for r in request_ids]

    def wait(self, pending: PendingStep) -> StepResult:
        """The step's results, once the device has finished it."""
        if pending is self._open:
            self._close(pending)
        if pending.error is not None:
            raise pending.error
        if pending.events is not None:
            pending.events[1].synchronize()
            assert self.timer is not None  # events are recorded only with a timer
            self.timer.finished(*pending.events, pending.mask_wait)
        if pending.sampled is None:
            return StepResult([], [], [], self._prompt_results(pending), pooled=self._pooled(pending))
        reqs = pending.requests
        ids = [r.request_id for r in reqs]
        sampled = pending.sampled.tolist()
        if pending.num_sampled is None:
            tokens, width = [[t] for t in sampled], 1
        else:
            tokens, width = [row[:c] for row, c in zip(sampled, pending.num_sampled.tolist())], len(sampled[0])
        logprobs: list[Logprobs | None] = [None] * len(reqs)
        if pending.logprobs is not None:
            top_ids, values, ranks = (t.tolist() for t in pending.logprobs)
            for r, req in enumerate(reqs):
                k = req.sampling_params.logprobs
                if k is not None:
                    flat = range(r * width, r * width + len(tokens[r]))  # a row per emitted token
                    logprobs[r] = Logprobs(
                        [top_ids[i][: 1 + k] for i in flat],
                        [values[i][: 1 + k] for i in flat],
                        [ranks[i] for i in flat],
                    )
        return StepResult(
            ids, tokens, logprobs, self._prompt_results(pending), pending.draft_token_ids, self._pooled(pending)
        )

    @staticmethod
    def _pooled(pending: PendingStep) -> dict[str, list[float]]:
        if pending.pooled is None:
            return {}
        ids, vectors = pending.pooled
        rows = vectors.tolist()
        return {rid: row[:n] for (rid, n), row in zip(ids, rows)}

    @staticmethod
    def _prompt_results(pending: PendingStep) -> dict[str, tuple[int, Logprobs]]:
        return {
            rows.request.request_id: (rows.start + 1, Logprobs(ids.tolist(), vals.tolist(), ranks.tolist()))
            for rows, ids, vals, ranks in pending.prompt_logprobs
        }

    @torch.inference_mode()
    def serve_steps(self) -> None:
        """A tensor-parallel rank other than 0: run rank 0's steps until it says stop. The same forward
        and the same logits computations in the same order, so that every collective pairs up; the
        logits themselves are rank 0's business."""
        while (header := receive_step(self.buffers)) is not None:
            inputs = self._upload(header)
            hidden = self._forward(inputs)
            for first_row, n in header.prompt_rows:
                for lo, hi in _prompt_logit_slices(n):
                    self._lm.compute_logits(hidden[first_row + lo : first_row + hi])
            if header.num_sample:
                self._lm.compute_logits(hidden[inputs.logits_indices])
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()

    def _prompt_logprobs(
        self, rows: PromptRows, hidden: torch.Tensor, lora_slots: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logprobs of prompt tokens start + 1 .. start + count on the device: per position the prompt
        token then the top-N (ids, values), and the prompt token's rank. Computed in slices that bound
        the [rows, vocab] logits. `lora_slots`: each token's LoRA slot with an LM-head adapter in the step."""
        k = rows.request.sampling_params.prompt_logprobs
        prompt = rows.request.prompt_token_ids
        ids, vals, ranks = [], [], []
        for lo, hi in _prompt_logit_slices(rows.count):
            span = slice(rows.first_row + lo, rows.first_row + hi)
            logprobs = torch.log_softmax(
                self._lm.compute_logits(hidden[span], None if lora_slots is None else lora_slots[span]), dim=-1
            )
            targets = to_device(prompt[rows.start + lo + 1 : rows.start + hi + 1], torch.int64, logprobs.device)[
                :, None
            ]
            target_lp = logprobs.gather(1, targets)
            ranks.append((logprobs > target_lp).sum(dim=-1) + 1)
            top = logprobs.topk(k, dim=-1) if k else None
            ids.append(targets if top is None else torch.cat([targets, top.indices], dim=1))
            vals.append(target_lp if top is None else torch.cat([target_lp, top.values], dim=1))
        return torch.cat(ids), torch.cat(vals), torch.cat(ranks)
