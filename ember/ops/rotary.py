"""Neox-style rotary embedding (rotate halves) over a model's cos/sin tables (ember.model.layers.
RotaryEmbedding, `rope` below): the Triton kernel, or PyTorch ops. Only the first `rope.rotary_dim`
channels of a head are rotated; the rest pass through unchanged.

On CPU, rotate_half(x) * sin is computed as roll(x, D / 2) * sin_signed, sin with its first half
negated: the same products bit for bit, in one op instead of four.

M-RoPE positions ([3, T], Qwen2.5-VL) reach the same kernels as per-token table rows
(`RotaryEmbedding.token_tables`): the Triton kernel then reads row t for token t.
"""

from __future__ import annotations

from typing import Any

import torch

from ember.cpu_native import ops as native
from ember.ops.target import Target


class _Rotary:
    """The partial-rotary split around an implementation's `rotate` of whole heads."""

    def __call__(
        self, rope: Any, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]."""
        rot = rope.rotary_dim
        if rot == q.shape[-1]:
            return self.rotate(rope, positions, q, k)
        q_rot, k_rot = self.rotate(rope, positions, q[..., :rot], k[..., :rot])
        return torch.cat((q_rot, q[..., rot:]), dim=-1), torch.cat((k_rot, k[..., rot:]), dim=-1)

    def rotate_qk(
        self, rope: Any, positions: torch.Tensor, qk: torch.Tensor, num_q_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same for queries and keys that are adjacent in each row: qk is [T, Hq + Hk, D], the query
        heads first (the fused QKV output's first columns)."""
        return self(rope, positions, qk[:, :num_q_heads], qk[:, num_q_heads:])

    def rotate(
        self, rope: Any, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class TritonRotary(_Rotary):
    @staticmethod
    def can_implement(target: Target, full: bool) -> bool:
        return target.triton

    def rotate(
        self, rope: Any, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from ember.kernels import apply_rotary

        if positions.dim() == 2:  # M-RoPE [3, T]: each token's own table row, read at its row index
            cos, sin = rope.token_tables(positions, rope.sin)
            return apply_rotary(torch.arange(cos.shape[0], device=cos.device), q, k, cos, sin)
        return apply_rotary(positions, q, k, rope.cos, rope.sin)


class TorchRotary(_Rotary):
    @staticmethod
    def can_implement(target: Target, full: bool) -> bool:
        return True

    def rotate(
        self, rope: Any, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope.rows(positions, q.dtype)
        half = q.shape[-1] // 2
        return (q * cos).add_(q.roll(half, dims=-1) * sin), (k * cos).add_(k.roll(half, dims=-1) * sin)


class TorchFullRotary(TorchRotary):
    """Every channel rotated: queries and keys in one pass, four operator calls per layer instead of
    eight, bit for bit the same products."""

    @staticmethod
    def can_implement(target: Target, full: bool) -> bool:
        return full

    def rotate_qk(
        self, rope: Any, positions: torch.Tensor, qk: torch.Tensor, num_q_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope.rows(positions, qk.dtype)
        out = (qk * cos).add_(qk.roll(qk.shape[-1] // 2, dims=-1) * sin)
        return out[:, :num_q_heads], out[:, num_q_heads:]


Tables = tuple[torch.Tensor, torch.Tensor]  # cos and signed sin [max_positions, head_dim]
QKNorms = tuple[Any, Any]  # a layer's q_norm and k_norm modules (ember.model.layers.RMSNorm)


class TritonRotaryStore:
    """On the GPU (or the interpreter), every channel rotated, a cache of the model's dtype: the QK norm
    (plain RMSNorms, one eps), rotary and the KV store in one launch (ember/kernels/rotary_store.py) for
    up to four; returns the queries [T, Hq, D]."""

    @staticmethod
    def can_implement(
        target: Target, cache_dtype: torch.dtype, tables: Tables | None, qk_norms: QKNorms | None
    ) -> bool:
        plain = qk_norms is None or (
            all(getattr(n, "style", None) == "llama" for n in qk_norms) and qk_norms[0].eps == qk_norms[1].eps
        )
        return target.triton and cache_dtype == target.dtype and tables is not None and plain

    def __init__(self, tables: Tables, num_heads: int, head_dim: int, qk_norms: QKNorms | None) -> None:
        self.cos, self.sin_signed = tables
        self.num_heads = num_heads
        self.qk_norms = qk_norms

    def __call__(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        from ember.kernels.rotary_store import rotary_store

        norms = self.qk_norms
        qk_norm = None if norms is None else (norms[0].weight, norms[1].weight, norms[0].eps)
        return rotary_store(
            positions, qkv, self.cos, self.sin_signed, k_cache, v_cache, slot_mapping, self.num_heads, qk_norm
        )


class NativeRotaryStore:
    """On CPU with float32 activations and an unscaled float32 cache, every channel rotated and no QK norm:
    rotary on the query and key heads in place and the keys and values into their slots, one native call
    (ember/cpu_native) for the PyTorch path's split, rotary ops and two index_copy_ (decode and prefill
    rows alike). Returns the queries [T, Hq, D] (rows strided in qkv), or None (per call: other dtypes
    or shapes) where the layer's rotary and store run."""

    @staticmethod
    def can_implement(
        target: Target, cache_dtype: torch.dtype, tables: Tables | None, qk_norms: QKNorms | None
    ) -> bool:
        return (
            target.native and cache_dtype == target.dtype == torch.float32 and tables is not None and qk_norms is None
        )

    def __init__(self, tables: Tables, num_heads: int, head_dim: int, qk_norms: None) -> None:
        self.cos, self.sin_signed = tables
        self.num_heads = num_heads
        self.head_dim = head_dim

    def __call__(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor | None:
        if not native.rotary_store_fits(qkv, positions, self.cos, k_cache, slot_mapping):
            return None
        native.rotary_store(qkv, positions, self.cos, self.sin_signed, k_cache, v_cache, slot_mapping, self.num_heads)
        return qkv[:, : self.num_heads * self.head_dim].view(-1, self.num_heads, self.head_dim)
