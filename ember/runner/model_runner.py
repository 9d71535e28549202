"""Owns the model and its KV cache on one device; turns a scheduled batch into sampled tokens.

Each step flattens the scheduled requests into one varlen batch (no padding between sequences):
token ids, positions, cache slots and per-sequence attention metadata, with one-token queries
ordered first so attention can treat them together.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import mmap
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ember.config import CacheConfig, EngineArgs, SchedulerConfig
from ember.distributed import host_group, tp_size
from ember.engine.request import Request
from ember.engine.scheduler import ScheduledBatch
from ember.model.attention import AttentionMetadata
from ember.model.loader import ModelFiles
from ember.model.registry import model_class
from ember.quant.formats import FP8_DTYPE
from ember.quant.linear import QuantEmbedding, QuantLinear
from ember.quant.quantize import QUANTIZERS
from ember.runner.cuda_graph import DecodeGraphs, capture_sizes
from ember.runner.input_buffers import InputBuffers
from ember.runner.step_broadcast import StepHeader, receive_step, send_step
from ember.sampling.sampler import Sampler, SamplerOutput, SamplingBatch

logger = logging.getLogger("ember")
_DEFAULT_CPU_KV_BYTES = 4 << 30
_PROMPT_LOGPROB_ROWS = 512  # prompt positions per [rows, vocab] logits slice


@dataclass
class StepOutput:
    """Sampled results for the requests that reached the end of their known tokens this step."""

    requests: list[Request]
    token_ids: list[int]
    # per request: (token id, logprob) pairs, the sampled token first, then the top-N, and the sampled
    # token's rank in the vocabulary; None where not asked
    logprobs: list[tuple[list[tuple[int, float]], int] | None]
    # per request asking for prompt logprobs: (prompt position p, pairs for prompt token p, its rank)
    prompt_logprobs: dict[Request, list[tuple[int, list[tuple[int, float]], int]]] = field(default_factory=dict)


@dataclass
class _StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    padded: int | None  # the CUDA graph size to replay, or None for an eager forward


class GpuIdleTimer:
    """Measures how long the GPU waits between the end of one step's work and the start of the next.

    CUDA events are recorded at the start and end of each step's GPU work; the gaps between them
    are time the GPU spent waiting on the host (scheduling, batch building, detokenization).
    """

    def __init__(self) -> None:
        self.idle_s = 0.0
        self.busy_s = 0.0
        self.steps = 0
        self._last_end: torch.cuda.Event | None = None
        self._start: torch.cuda.Event | None = None

    def step_start(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def step_end(self) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        if self._last_end is not None:
            self.idle_s += self._last_end.elapsed_time(self._start) / 1e3
        self.busy_s += self._start.elapsed_time(end) / 1e3
        self.steps += 1
        self._last_end = end


def _return_freed_memory_to_os() -> None:
    """Loading builds float layers, then replaces them (quantized GGUF, --quantization); glibc keeps the
    freed heap, about 250 MiB of idle RSS for the default model, unless asked to give it back."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass


def _check_fp8_support(device: torch.device) -> None:
    """fp8 weights need fp8 tensor cores (Ada/Hopper and newer); fp8 KV needs only the fp8 dtype."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("quantization 'fp8' needs a CUDA GPU with fp8 tensor cores (compute capability 8.9+, "
                         "e.g. L4, H100, H200); use int8 or int4 on this device")


@contextmanager
def _skip_weight_init():
    """Linear and embedding weights start uninitialised: the checkpoint (or the dummy init) fills every
    one, and `load_weights` checks that. PyTorch's random init cost 0.7 s of the default model's load,
    and touching float weights that quantized layers then replace costs resident memory."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _prompt_logit_slices(n: int) -> list[tuple[int, int]]:
    """Row ranges of one request's prompt logprobs, each bounding a [rows, vocab] logits tensor."""
    return [(lo, min(n, lo + _PROMPT_LOGPROB_ROWS)) for lo in range(0, n, _PROMPT_LOGPROB_ROWS)]


class ModelRunner:
    """One rank's model and KV cache. Rank 0 (the engine's) builds each step from the scheduler's
    batch and, under tensor parallelism, broadcasts its description; other ranks `serve_steps`,
    mirroring every forward and logits computation so the collectives inside them line up."""

    def __init__(self, files: ModelFiles, args: EngineArgs, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, device: torch.device | None = None) -> None:
        self.device = device or args.torch_device
        self.dtype = args.torch_dtype(self.device, files.checkpoint_dtype)
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.model_config = cfg = files.model_config
        self.block_size = cache_config.block_size
        torch.manual_seed(args.seed)
        max_positions = max(scheduler_config.max_model_len, cfg.max_position_embeddings)
        with torch.device(self.device), _default_dtype(self.dtype), _skip_weight_init():
            self.model = model_class(cfg, files.source)(cfg, max_positions)
        self.quantization = files.quantization
        if self.quantization == "fp8":
            _check_fp8_support(self.device)
        with torch.no_grad():
            if files.weights is None:
                self.model.init_dummy_weights(args.seed)
            else:
                self.model.load_weights(files.weights(), files.source)
            if self.quantization in QUANTIZERS:
                self.model.quantize(self.quantization)
        self.model.eval()
        _return_freed_memory_to_os()
        self.kv_dtype = FP8_DTYPE if args.kv_cache_dtype != "auto" else self.dtype
        self.sampler = Sampler()
        self.num_blocks = 0
        self.enforce_eager = args.enforce_eager
        max_blocks = -(-scheduler_config.max_model_len // self.block_size)
        self.buffers = InputBuffers(max(scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs),
                                    scheduler_config.max_num_seqs, max_blocks, self.device)
        self.graphs: DecodeGraphs | None = None
        self.idle_timer: GpuIdleTimer | None = None

    # ---- KV cache -------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * self.model.layout.num_kv_heads * cfg.head_dim * elem

    def prepare_cache(self) -> int:
        """Size, allocate and capture: every rank runs this same sequence (its collectives must pair up)."""
        num_blocks = self.determine_num_blocks()
        self.allocate_kv_cache(num_blocks)
        self.capture_cuda_graphs()
        return num_blocks

    def determine_num_blocks(self) -> int:
        """`--kv-cache-memory` when given; else on GPU what `--gpu-memory-utilization` leaves after a forward
        at the largest batch, and on CPU a fixed 4 GiB."""
        cap = self.scheduler_config.max_num_seqs * -(-self.scheduler_config.max_model_len // self.block_size)
        if self.cache_config.kv_cache_memory_bytes is not None:
            budget = self.cache_config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            peak = self._profile_peak_memory()
            budget = total * self.cache_config.gpu_memory_utilization - (total - free) - peak
            logger.info("GPU memory: total %.1f GiB, in use %.2f GiB, activation peak %.2f GiB",
                        total / 2**30, (total - free) / 2**30, peak / 2**30)
        else:
            budget = _DEFAULT_CPU_KV_BYTES
        num_blocks = min(int(budget // self.bytes_per_block), cap)
        if tp_size() > 1:  # every rank's pool holds the same blocks: the smallest budget decides
            agreed = torch.tensor([num_blocks], dtype=torch.int64)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=host_group())
            num_blocks = int(agreed.item())
        if num_blocks < 1:
            raise ValueError("not enough memory for a single KV cache block: raise --gpu-memory-utilization "
                             "or --kv-cache-memory")
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
        self.allocate_kv_cache(sum(blocks))
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
            slot_mapping=torch.cat([tables[r, : blocks[r]].repeat_interleave(self.block_size)[:n] * self.block_size
                                    + torch.arange(n) % self.block_size for r, n in enumerate(lens)]).to(dev),
            block_tables=tables.to(dev), seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev), num_decodes=0,
            max_query_len=max(lens), max_seq_len=max(lens), seq_lens_host=lens, query_start_host=starts)
        ids = torch.zeros(tokens, dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        with torch.inference_mode():
            hidden = self.model(ids, positions, meta)
            self.model.compute_logits(hidden[: min(self.scheduler_config.max_num_seqs, tokens)])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        self.release_kv_cache()
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model_config
        shape = (num_blocks, self.block_size, self.model.layout.num_kv_heads, cfg.head_dim)
        for attn in self.model.attention_layers():
            attn.k_cache = self._zeros(shape)
            attn.v_cache = self._zeros(shape)
        self.num_blocks = num_blocks

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed cache tensor. On CPU, an anonymous memory map leaves untouched pages unmapped, so a
        large `--kv-cache-memory` costs resident memory only as blocks are used (torch.zeros writes
        every page at once). Not numpy's zeros: it advises huge pages for large arrays, and the
        kernel's khugepaged then fills whole 2 MiB pages around each touched block."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        nbytes = math.prod(shape) * torch.empty((), dtype=self.kv_dtype).element_size()
        raw = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
        return torch.from_numpy(raw).view(self.kv_dtype).view(shape)

    def release_kv_cache(self) -> None:
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = None
        self.num_blocks = 0

    @property
    def weight_bytes(self) -> int:
        """Bytes of every parameter plus the codes, scales and zeros of quantized layers (a tied
        embedding and LM head counted once)."""
        tensors = {id(p): p for p in self.model.parameters()}
        for module in self.model.modules():
            if isinstance(module, (QuantLinear, QuantEmbedding)):
                tensors.update((id(t), t) for t in module.weight_tensors())
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def capture_cuda_graphs(self) -> None:
        if self.device.type != "cuda" or self.enforce_eager:
            return
        before = torch.cuda.memory_reserved(self.device)
        with torch.inference_mode():
            self.graphs = DecodeGraphs(self.model, self.buffers, self.scheduler_config.max_model_len,
                                       capture_sizes(self.scheduler_config.max_num_seqs))
        logger.info("CUDA graph memory: %.2f GiB", (torch.cuda.memory_reserved(self.device) - before) / 2**30)

    # ---- one step -------------------------------------------------------------------------

    def _prepare(self, batch: ScheduledBatch) -> tuple[StepHeader, list[int], list[tuple[int, int, int, int]]]:
        """Fill the host buffers for this step, one-token queries first.

        Returns the step's header, the batch indices of the requests that sample (in logits order),
        and per request wanting prompt logprobs: (batch index, first flat token row, first position,
        number of rows)."""
        order = sorted(range(len(batch)), key=lambda i: batch.num_new_tokens[i] != 1)
        b, bs = self.buffers, self.block_size
        ids, pos, slots = b.input_ids.np, b.positions.np, b.slot_mapping.np
        tables, seq_lens, qsl, logits_idx = b.block_tables.np, b.seq_lens.np, b.query_start_loc.np, b.logits_indices.np
        t = num_decodes = max_query_len = max_seq_len = 0
        sample_rows: list[int] = []
        prompt_rows: list[tuple[int, int, int, int]] = []
        for row, i in enumerate(order):
            req, n = batch.requests[i], batch.num_new_tokens[i]
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            tables[row, : len(req.block_ids)] = req.block_ids
            if n == 1:
                num_decodes += 1
                ids[t] = req.all_token_ids[start]
                pos[t] = start
                slots[t] = req.block_ids[start // bs] * bs + start % bs
            else:
                max_query_len = max(max_query_len, n)
                p = np.arange(start, end)
                ids[t:t + n] = req.all_token_ids[start:end]
                pos[t:t + n] = p
                slots[t:t + n] = tables[row, p // bs] * bs + p % bs
            if req.prompt_logprobs is not None:
                # Logits at position p predict prompt token p + 1.
                last = min(end, req.num_prompt_tokens - 1)
                if start < last:
                    prompt_rows.append((i, t, start, last - start))
            t += n
            seq_lens[row] = end
            qsl[row + 1] = t
            max_seq_len = max(max_seq_len, end)
            if end == req.num_tokens:
                logits_idx[len(sample_rows)] = t - 1
                sample_rows.append(i)
        num_seqs, num_tokens = len(order), t
        padded = None
        if self.graphs is not None and num_decodes == num_seqs:
            padded = self.graphs.padded_size(num_seqs)
        if padded is not None:  # pad rows write nowhere and attend to one cached token
            ids[num_tokens:padded] = 0
            pos[num_tokens:padded] = 0
            slots[num_tokens:padded] = -1
            seq_lens[num_seqs:padded] = 1
        header = StepHeader(num_tokens=num_tokens, num_seqs=num_seqs, num_decodes=num_decodes,
                            max_query_len=max_query_len, max_seq_len=max_seq_len, padded=padded or 0,
                            num_sample=len(sample_rows), table_width=-(-max_seq_len // bs),
                            prompt_rows=[(first_row, n) for _, first_row, _, n in prompt_rows])
        return header, sample_rows, prompt_rows

    def _upload(self, h: StepHeader) -> _StepInputs:
        """Device tensors (and host lists for the PyTorch attention path) from the filled host buffers."""
        b = self.buffers
        tokens, rows = h.tokens, h.rows
        meta = AttentionMetadata(
            slot_mapping=b.slot_mapping.upload(tokens)[:h.num_tokens],
            block_tables=b.block_tables.upload(rows)[:h.num_seqs],
            seq_lens=b.seq_lens.upload(rows)[:h.num_seqs],
            query_start_loc=b.query_start_loc.upload(h.num_seqs + 1),
            num_decodes=h.num_decodes, max_query_len=h.max_query_len, max_seq_len=h.max_seq_len,
            seq_lens_host=b.seq_lens.np[:h.num_seqs].tolist(),
            query_start_host=b.query_start_loc.np[:h.num_seqs + 1].tolist())
        return _StepInputs(b.input_ids.upload(tokens)[:h.num_tokens], b.positions.upload(tokens)[:h.num_tokens], meta,
                           b.logits_indices.upload(h.num_sample), h.padded or None)

    def _forward(self, inputs: _StepInputs) -> torch.Tensor:
        if inputs.padded is not None:
            return self.graphs.replay(inputs.padded)
        return self.model(inputs.input_ids, inputs.positions, inputs.meta)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, eos_token_ids: list[int]) -> StepOutput:
        if self.idle_timer is not None:
            self.idle_timer.step_start()
        header, sample_rows, prompt_rows = self._prepare(batch)
        if tp_size() > 1:
            send_step(header, self.buffers)
        inputs = self._upload(header)
        reqs = [batch.requests[i] for i in sample_rows]
        sbatch = None
        if reqs:  # built before the forward so its host-to-device copies overlap the GPU's work
            sbatch = SamplingBatch.build(
                params=[r.sampling_params for r in reqs],
                prompt_token_ids=[r.prompt_token_ids for r in reqs],
                output_token_ids=[r.output_token_ids for r in reqs],
                generators=[r.generator for r in reqs],
                eos_token_ids=eos_token_ids,
                vocab_size=self.model_config.vocab_size,
                device=self.device,
            )
        hidden = self._forward(inputs)
        prompt_logprobs = {batch.requests[i]: self._prompt_logprobs(batch.requests[i], hidden, first_row, start, n)
                           for i, first_row, start, n in prompt_rows}
        out = None
        if sbatch is not None and sbatch.argmax_only:
            out = SamplerOutput(self.model.greedy_tokens(hidden[inputs.logits_indices]), None, None)
        elif sbatch is not None:
            out = self.sampler(self.model.compute_logits(hidden[inputs.logits_indices]), sbatch)
        if self.idle_timer is not None:
            self.idle_timer.step_end()
        if out is None:
            if self.device.type == "cuda":  # the next step refills the pinned input buffers: let the copies land
                torch.cuda.current_stream(self.device).synchronize()
            return StepOutput([], [], [], prompt_logprobs)
        tokens = out.sampled_token_ids.tolist()
        logprobs: list[tuple[list[tuple[int, float]], int] | None] = [None] * len(reqs)
        if out.logprobs is not None:
            lp_ids, lp_vals, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_ranks.tolist()
            for r, req in enumerate(reqs):
                k = req.sampling_params.logprobs
                if k is not None:
                    logprobs[r] = (list(zip(lp_ids[r][: 1 + k], lp_vals[r][: 1 + k])), ranks[r])
        return StepOutput(reqs, tokens, logprobs, prompt_logprobs)

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
                    self.model.compute_logits(hidden[first_row + lo:first_row + hi])
            if header.num_sample:
                self.model.compute_logits(hidden[inputs.logits_indices])
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()

    def _prompt_logprobs(self, req: Request, hidden: torch.Tensor, first_row: int, start: int, n: int
                         ) -> list[tuple[int, list[tuple[int, float]], int]]:
        """Logprobs of prompt tokens start + 1 .. start + n, in slices that bound the [rows, vocab] logits."""
        k = req.sampling_params.prompt_logprobs
        result = []
        for lo, hi in _prompt_logit_slices(n):
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[first_row + lo:first_row + hi]), dim=-1)
            targets = torch.tensor(req.prompt_token_ids[start + lo + 1:start + hi + 1], device=logprobs.device)
            target_lp = logprobs.gather(1, targets[:, None])
            ranks = ((logprobs > target_lp).sum(dim=-1) + 1).tolist()
            top = logprobs.topk(k, dim=-1) if k else None
            ids = targets[:, None] if top is None else torch.cat([targets[:, None], top.indices], dim=1)
            vals = target_lp if top is None else torch.cat([target_lp, top.values], dim=1)
            for r, (row_ids, row_vals) in enumerate(zip(ids.tolist(), vals.tolist())):
                result.append((start + lo + r + 1, list(zip(row_ids, row_vals)), ranks[r]))
        return result
