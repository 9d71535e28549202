"""How an fp8 KV cache stores and reads values: scales for keys and for values, each either one float
for the layer or one per KV head.

A stored value is x / scale saturated to +-448 and reads as float(stored) * scale; caches in any other
dtype hold values as is and take scales of 1.0. Per-head scales are a float32 tensor [num_kv_heads] on
the cache's device (a head whose keys run larger than its neighbours' keeps its precision); the kernels
read them once per program, so they cost nothing per element, and a CUDA graph reads them at replay.
These rules live in their own module, which imports no Triton (CPU installs have none), so the PyTorch
path (ember.ops.attention) and the kernels' references share them without the kernels importing the ops
above them. The fp8 type and its range are ember.quant.formats' FP8_DTYPE and FP8_MAX, shared with fp8 weights.
"""

from __future__ import annotations

import torch

from ember.quant.formats import FP8_DTYPE, FP8_MAX

KVScale = float | torch.Tensor  # a host float for the layer, or float32 [num_kv_heads]


def check_kv_scales(
    cache_dtype: torch.dtype, k_scale: KVScale, v_scale: KVScale, num_kv_heads: int | None = None
) -> None:
    """Layer scales are host floats, so CUDA-graph capture never reads the device for them; per-head
    scales are tensors of one float32 per KV head, both of one kind. Only fp8 caches are scaled; a scale
    other than 1.0 on any other cache is a caller's mistake that would otherwise be silently ignored."""
    if isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor):
        if not (isinstance(k_scale, torch.Tensor) and isinstance(v_scale, torch.Tensor)) or any(
            s.dtype != torch.float32 or s.dim() != 1 for s in (k_scale, v_scale)
        ):
            raise TypeError(
                "k_scale and v_scale must be Python floats or both float32 tensors of one scale per "
                f"KV head, got {_describe(k_scale)} and {_describe(v_scale)}"
            )
        if cache_dtype != FP8_DTYPE:
            raise ValueError(f"per-head k_scale and v_scale apply only to fp8 caches, not {cache_dtype}")
        if num_kv_heads is not None and (k_scale.numel() != num_kv_heads or v_scale.numel() != num_kv_heads):
            raise ValueError(
                f"per-head k_scale ({k_scale.numel()}) and v_scale ({v_scale.numel()}) need one "
                f"scale for each of the {num_kv_heads} KV heads"
            )
        return
    if not all(isinstance(s, (int, float)) for s in (k_scale, v_scale)):
        raise TypeError(f"k_scale and v_scale must be Python floats, got {type(k_scale)} and {type(v_scale)}")
    if cache_dtype != FP8_DTYPE and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError(f"k_scale {k_scale} and v_scale {v_scale} apply only to fp8 caches, not {cache_dtype}")


def _describe(s: KVScale) -> str:
    return f"a {s.dtype} tensor of shape {tuple(s.shape)}" if isinstance(s, torch.Tensor) else repr(type(s))


def _per_head(scale: KVScale) -> KVScale:
    """A scale that broadcasts over [..., Hk, D]."""
    return scale[:, None] if isinstance(scale, torch.Tensor) else scale


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: KVScale) -> torch.Tensor:
    """x [..., Hk, D] as a cache of `cache_dtype` holds it: fp8 caches x / scale, clamped first so that
    large values saturate rather than cast to NaN; other caches take x as is."""
    if cache_dtype != FP8_DTYPE:
        return x
    return (x.float() / _per_head(scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(stored: torch.Tensor, scale: KVScale, dtype: torch.dtype) -> torch.Tensor:
    """The values a slice [..., Hk, D] of an fp8 cache stands for, in `dtype`; other caches hold their
    values as is, so their slices come back untouched (no copy)."""
    if stored.dtype != FP8_DTYPE:
        return stored
    return (stored.float() * _per_head(scale)).to(dtype)
