"""Multi-head latent attention over the paged latent cache (ember/model/mla.py says what the rows hold).

A batch holds `num_decodes` one-token queries first, then prefill chunks (ember.ops.attention's
AttentionMetadata). Each implementation `store`s a step's new rows ([T, cache_dim], slot -1 skipped on
the Triton path) and, called, gives every query's attention output per head, [T, H, v_head_dim]. The
Triton one also `prepare`s them: from the projections' outputs, the latent's norm, the rotary of the query's
and the key's rotated channels and the store in one kernel (ember/kernels/mla_prep.py), where the layer's
rotary tables allow (LatentPrep); TorchMLA leaves that to the layer's own ops.

* one-token queries, absorbed: q_lat = q_nope W_UK (per head, [L]), scores = (q_lat . c + q_pe . k_pe) *
  scale over the sequence's cached rows, o_lat = softmax . c, out = o_lat W_UV^T. `attend_latent` is the
  middle part, the only one that reads the cache: PyTorch's gather + two matmuls (TorchMLA, also the
  reference), or one Triton kernel over the paged rows in place (TritonMLA, ember/kernels/mla_decode.py).
* prefill chunks, decompressed: the sequence's rows gathered, kv_b_proj applied to the latents (each
  head's unrotated key and value, as transformers computes them), and one SDPA call per chunk with the
  causal mask offset by its cached context. Both implementations run this in PyTorch (on the GPU too:
  steps with prefill rows run eagerly for MLA models, see ModelRunner.capture_cuda_graphs).

An fp8 cache (`--kv-cache-dtype fp8`) stores each row quantized by the layer's `kv_scale` under the fp8 KV
cache's rules (ember.quant.kv_scale: the latent row is the layer's one KV head). Both paths dequantize
what they read: the PyTorch one each gathered sequence's rows (decode and prefill), the kernel each tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ember.ops.attention import AttentionMetadata, Masking, copy_to_slots, decode_plan
from ember.ops.target import Target
from ember.quant.kv_scale import KVScale, check_kv_scales, dequantize_kv, quantize_kv

# The prefill's attention backends: every one but cuDNN's, which builds a graph for each new shape (each
# prompt length) on the host. In the DeepSeek-V2-Lite shape's nano-vllm run (H100, 2026-12-07,
# benchmarks/results/h100-2026-12-07-b.md) the prefill steps, ~15 prompts a step, each its own shape, held
# the device idle 780 ms a step beside 150 ms of work: 12 s of the run's 29, with 414 cuDNN attention calls a
# step. The memory-efficient kernel takes q/k's 192 columns against v's 128; math is the last resort.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class MlaShape:
    """What an implementation is chosen by, known once a layer's cache is set."""

    dtype: torch.dtype
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    block_size: int


@dataclass(frozen=True)
class LatentPrep:
    """What a fused prep (`prepare`) reads besides a step's tensors: the rotary tables, cos and signed sin
    [max_positions, rope] (RotaryEmbedding.full_tables), kv_a_layernorm's weight [L] and eps, and whether
    the rotated channels pair as (2j, 2j + 1) (DeepSeek's `rope_interleave`)."""

    cos: torch.Tensor
    sin_signed: torch.Tensor
    norm_weight: torch.Tensor
    norm_eps: float
    interleaved: bool


@dataclass(frozen=True)
class AbsorbedWeights:
    """kv_b_proj's rows per head: W_UK [H, nope, L] (keys) and W_UV^T [H, L, v] (values)."""

    w_uk: torch.Tensor
    w_uv_t: torch.Tensor


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[T, H, nope] -> [T, H, L]: each head's unrotated query in the latent space."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def expand_output(o_lat: torch.Tensor, w_uv_t: torch.Tensor) -> torch.Tensor:
    """[T, H, L] -> [T, H, v]: each head's latent attention output through its value rows."""
    return torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)


class TorchMLA:
    @staticmethod
    def can_implement(target: Target, shape: MlaShape) -> bool:
        return True

    def __init__(self, shape: MlaShape) -> None:
        self.kv_lora_rank = shape.kv_lora_rank

    def store(self, rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scale: KVScale) -> None:
        check_kv_scales(cache.dtype, kv_scale, kv_scale, 1)
        copy_to_slots(cache, slot_mapping, quantize_kv(rows[:, None], cache.dtype, kv_scale).to(cache.dtype))

    def prepare(
        self,
        positions: torch.Tensor,
        q_pe: torch.Tensor,
        kv: torch.Tensor,
        prep: LatentPrep,
        cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scale: KVScale,
    ) -> torch.Tensor | None:
        """The fused prep: None here, where the layer runs its norm, rotary and `store` as separate ops."""
        return None

    def __call__(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        absorbed: AbsorbedWeights,
        kv_b_proj: Any,
        scale: float,
        kv_scale: KVScale,
    ) -> torch.Tensor:
        check_kv_scales(cache.dtype, kv_scale, kv_scale, 1)
        nd, tokens = meta.num_decodes, q_nope.shape[0]
        if nd == tokens:
            return self.decode(q_nope, q_pe, cache, meta, absorbed, scale, kv_scale)
        heads, v_dim = q_nope.shape[1], absorbed.w_uv_t.shape[2]
        new = torch.zeros if meta.pad_rows else torch.empty
        out = new(tokens, heads, v_dim, dtype=q_nope.dtype, device=q_nope.device)
        if nd:
            out[:nd] = self.decode(q_nope[:nd], q_pe[:nd], cache, meta, absorbed, scale, kv_scale)
        for i in range(nd, len(meta.seq_lens_host)):
            start, end = meta.query_start_host[i], meta.query_start_host[i + 1]
            out[start:end] = self._prefill_chunk(
                q_nope[start:end], q_pe[start:end], cache, meta, i, kv_b_proj, v_dim, scale, kv_scale
            )
        return out

    def decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        absorbed: AbsorbedWeights,
        scale: float,
        kv_scale: KVScale,
    ) -> torch.Tensor:
        """The one-token queries [nd, H, *] -> [nd, H, v], absorbed (no decompression)."""
        q = torch.cat([absorb_query(q_nope, absorbed.w_uk), q_pe], dim=-1)
        return expand_output(self.attend_latent(q, cache, meta, scale, kv_scale), absorbed.w_uv_t)

    def attend_latent(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float, kv_scale: KVScale
    ) -> torch.Tensor:
        """q [nd, H, L + rope] over each sequence's cached rows -> [nd, H, L] (the rows' latents as values)."""
        nd = q.shape[0]
        if (None, None) not in meta.cpu_decode:  # the plan of global layers: every block of each sequence
            meta.cpu_decode[None, None] = decode_plan(meta, cache.shape[1], Masking())
        ids, keys, mask = meta.cpu_decode[None, None]
        rows = dequantize_kv(cache.index_select(0, ids).view(nd, -1, cache.shape[-1])[:, :keys], kv_scale, q.dtype)
        scores = torch.matmul(q, rows.transpose(1, 2)) * scale  # [nd, H, S]
        if mask is not None:
            scores = scores.masked_fill(~mask[:, 0], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, rows[..., : self.kv_lora_rank])

    def _prefill_chunk(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        i: int,
        kv_b_proj: Any,
        v_dim: int,
        scale: float,
        kv_scale: KVScale,
    ) -> torch.Tensor:
        """One chunk's queries [Q, H, *] against its sequence's decompressed context -> [Q, H, v]."""
        q_len, seq_len = q_nope.shape[0], meta.seq_lens_host[i]
        ctx, heads, nope = seq_len - q_len, q_nope.shape[1], q_nope.shape[2]
        latent_dim = self.kv_lora_rank
        block_ids = meta.block_tables[i, : -(-seq_len // cache.shape[1])]
        rows = dequantize_kv(
            cache.index_select(0, block_ids).view(-1, cache.shape[-1])[:seq_len], kv_scale, q_nope.dtype
        )
        latent, k_pe = rows.split([latent_dim, q_pe.shape[2]], dim=-1)
        k_nope, v = kv_b_proj(latent.contiguous()).view(seq_len, heads, nope + v_dim).split([nope, v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].expand(seq_len, heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        qb, kb, vb = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, *, *]
        with sdpa_kernel(PREFILL_BACKENDS):
            if ctx == 0:
                o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
            else:
                pos = torch.arange(seq_len, device=q.device)[None, :]
                mask = pos <= torch.arange(q_len, device=q.device)[:, None] + ctx
                o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask[None, None], scale=scale)
        return o[0].transpose(0, 1)


class TritonMLA(TorchMLA):
    """One-token queries read the paged latent rows in place (ember/kernels/mla_decode.py, split over the
    context); rows are stored by a kernel that skips slot -1 (CUDA graphs' padding), and where the layer
    offers a LatentPrep, `prepare`d by one: the latent's norm, the rotary and the store in one launch
    (ember/kernels/mla_prep.py). Prefill as TorchMLA."""

    @staticmethod
    def can_implement(target: Target, shape: MlaShape) -> bool:
        return target.triton

    def store(self, rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scale: KVScale) -> None:
        from ember.kernels.mla_decode import store_latent

        store_latent(rows, cache, slot_mapping, kv_scale)

    def prepare(
        self,
        positions: torch.Tensor,
        q_pe: torch.Tensor,
        kv: torch.Tensor,
        prep: LatentPrep,
        cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scale: KVScale,
    ) -> torch.Tensor:
        """q_pe [T, H, rope] rotated (a new tensor), with kv [T, L + rope]'s row [normed latent, rotated
        k_pe] stored at `slot_mapping` (-1 skipped)."""
        from ember.kernels.mla_prep import mla_prep

        return mla_prep(
            positions,
            q_pe,
            kv,
            prep.cos,
            prep.sin_signed,
            prep.norm_weight,
            prep.norm_eps,
            cache,
            slot_mapping,
            kv_scale,
            prep.interleaved,
        )

    def attend_latent(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float, kv_scale: KVScale
    ) -> torch.Tensor:
        from ember.kernels.mla_decode import mla_decode_attention

        nd = q.shape[0]
        return mla_decode_attention(
            q,
            cache,
            meta.block_tables[:nd],
            meta.seq_lens[:nd],
            scale,
            self.kv_lora_rank,
            max_seq_len=meta.max_seq_len,
            kv_scale=kv_scale,
        )
