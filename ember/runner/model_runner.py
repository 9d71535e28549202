"""Owns the model and its KV cache on one device; turns a scheduled batch into sampled tokens.

Each step flattens the scheduled requests into one varlen batch (no padding between sequences):
token ids, positions, cache slots and per-sequence attention metadata, with one-token queries
ordered first so attention can treat them together.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ember.config import CacheConfig, EngineArgs, SchedulerConfig
from ember.engine.request import Request
from ember.engine.scheduler import ScheduledBatch
from ember.model.attention import AttentionMetadata
from ember.model.loader import ModelFiles
from ember.model.registry import model_class
from ember.sampling.sampler import Sampler, SamplingBatch

logger = logging.getLogger("ember")
_DEFAULT_CPU_KV_BYTES = 4 << 30


@dataclass
class StepOutput:
    """Sampled results for the requests that reached the end of their known tokens this step."""

    requests: list[Request]
    token_ids: list[int]
    # per request: (token id, logprob) pairs, the sampled token first, then the top-N, and the sampled
    # token's rank in the vocabulary; None where not asked
    logprobs: list[tuple[list[tuple[int, float]], int] | None]


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner:
    def __init__(self, files: ModelFiles, args: EngineArgs, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig) -> None:
        self.device = args.torch_device
        self.dtype = args.torch_dtype(self.device, files.checkpoint_dtype)
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.model_config = cfg = files.model_config
        self.block_size = cache_config.block_size
        torch.manual_seed(args.seed)
        max_positions = max(scheduler_config.max_model_len, cfg.max_position_embeddings)
        with torch.device(self.device), _default_dtype(self.dtype):
            self.model = model_class(cfg, files.source)(cfg, max_positions)
        with torch.no_grad():
            if files.weights is None:
                self.model.init_dummy_weights(args.seed)
            else:
                self.model.load_weights(files.weights(), files.source)
        self.model.eval()
        self.sampler = Sampler()
        self.num_blocks = 0

    # ---- KV cache -------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * cfg.num_key_value_heads * cfg.head_dim * elem

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
        if num_blocks < 1:
            raise ValueError("not enough memory for a single KV cache block: raise --gpu-memory-utilization "
                             "or --kv-cache-memory")
        return num_blocks

    def _profile_peak_memory(self) -> int:
        """Extra GPU memory a forward + sampling pass at the token budget needs beyond what is allocated now."""
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = self.scheduler_config.max_num_batched_tokens
        max_len = self.scheduler_config.max_model_len
        lens = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
        self.allocate_kv_cache(sum(-(-n // self.block_size) for n in lens))
        offset, prefills = 0, []
        block = 0
        for n in lens:
            nb = -(-n // self.block_size)
            prefills.append((offset, n, n, torch.arange(block, block + nb, device=self.device)))
            offset, block = offset + n, block + nb
        meta = AttentionMetadata(
            slot_mapping=torch.arange(tokens, device=self.device), num_decodes=0,
            decode_block_tables=torch.zeros(0, 1, dtype=torch.long, device=self.device),
            decode_seq_lens=torch.zeros(0, dtype=torch.long, device=self.device), prefills=prefills)
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        with torch.inference_mode():
            hidden = self.model(ids, positions, meta)
            rows = min(self.scheduler_config.max_num_seqs, tokens)
            self.model.compute_logits(hidden[:rows])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.release_kv_cache()
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model_config
        shape = (num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        for attn in self.model.attention_layers():
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.num_blocks = num_blocks

    def release_kv_cache(self) -> None:
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = None
        self.num_blocks = 0

    # ---- one step -------------------------------------------------------------------------

    def _prepare(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor, torch.Tensor, AttentionMetadata,
                                                       list[int]]:
        order = sorted(range(len(batch)), key=lambda i: batch.num_new_tokens[i] != 1)
        bs = self.block_size
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        sample_rows: list[int] = []
        logits_indices: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills = []
        for i in order:
            req, n = batch.requests[i], batch.num_new_tokens[i]
            start = req.num_computed_tokens
            seq_len = start + n
            pos = np.arange(start, seq_len)
            table = np.asarray(req.block_ids, dtype=np.int64)
            slots.append(table[pos // bs] * bs + pos % bs)
            positions.append(pos)
            q_start = len(ids)
            ids.extend(req.all_token_ids[start:seq_len])
            if n == 1:
                decode_tables.append(req.block_ids[: -(-seq_len // bs)])
                decode_lens.append(seq_len)
            else:
                nblocks = -(-seq_len // bs)
                prefills.append((q_start, n, seq_len, torch.as_tensor(table[:nblocks], device=self.device)))
            if seq_len == req.num_tokens:
                sample_rows.append(i)
                logits_indices.append(len(ids) - 1)
        width = max((len(t) for t in decode_tables), default=1)
        padded = np.zeros((len(decode_tables), width), dtype=np.int64)
        for r, t in enumerate(decode_tables):
            padded[r, : len(t)] = t
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            num_decodes=len(decode_tables),
            decode_block_tables=torch.from_numpy(padded).to(dev),
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.long, device=dev),
            prefills=prefills,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        return sample_rows, input_ids, pos_t, meta, logits_indices

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, eos_token_ids: list[int]) -> StepOutput:
        sample_rows, input_ids, positions, meta, logits_indices = self._prepare(batch)
        hidden = self.model(input_ids, positions, meta)
        if not sample_rows:
            return StepOutput([], [], [])
        idx = torch.tensor(logits_indices, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[idx])
        reqs = [batch.requests[i] for i in sample_rows]
        sbatch = SamplingBatch.build(
            params=[r.sampling_params for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            generators=[r.generator for r in reqs],
            eos_token_ids=eos_token_ids,
            vocab_size=logits.shape[-1],
            device=self.device,
        )
        out = self.sampler(logits, sbatch)
        tokens = out.sampled_token_ids.tolist()
        logprobs: list[tuple[list[tuple[int, float]], int] | None] = [None] * len(reqs)
        if out.logprobs is not None:
            lp_ids, lp_vals, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_ranks.tolist()
            for r, req in enumerate(reqs):
                k = req.sampling_params.logprobs
                if k is not None:
                    logprobs[r] = (list(zip(lp_ids[r][: 1 + k], lp_vals[r][: 1 + k])), ranks[r])
        return StepOutput(reqs, tokens, logprobs)
