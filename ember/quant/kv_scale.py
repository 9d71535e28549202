"""How an fp8 KV cache stores and reads values: one float scale per layer for keys and one for values.

A stored value is x / scale saturated to +-448 and reads as float(stored) * scale; caches in any other
dtype hold values as is and take scales of 1.0. These rules live in their own module, which imports no
Triton (CPU installs have none), so the PyTorch path (ember.model.attention) and the kernels' references
share them without the kernels importing model code. The fp8 type and its range are
ember.quant.formats' FP8_DTYPE and FP8_MAX, shared with fp8 weights.
"""

from __future__ import annotations

import torch

from ember.quant.formats import FP8_DTYPE, FP8_MAX


def check_kv_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """Scales are host floats, so CUDA-graph capture never reads the device for them. Only fp8
    caches are scaled; a scale other than 1.0 on any other cache is a caller's mistake that would
    otherwise be silently ignored."""
    if not all(isinstance(s, (int, float)) for s in (k_scale, v_scale)):
        raise TypeError(f"k_scale and v_scale must be Python floats, got {type(k_scale)} and {type(v_scale)}")
    if cache_dtype != FP8_DTYPE and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError(f"k_scale {k_scale} and v_scale {v_scale} apply only to fp8 caches, not {cache_dtype}")


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a cache of `cache_dtype` holds it: fp8 caches x / scale, clamped first so that large
    values saturate rather than cast to NaN; other caches take x as is."""
    if cache_dtype != FP8_DTYPE:
        return x
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The values a slice of an fp8 cache stands for, in `dtype`; other caches hold their values
    as is, so their slices come back untouched (no copy)."""
    if stored.dtype != FP8_DTYPE:
        return stored
    return (stored.float() * scale).to(dtype)
