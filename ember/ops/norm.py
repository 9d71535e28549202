"""RMSNorm, optionally fused with the residual add that precedes it: one Triton kernel on CUDA, one native
call on CPU in float32 (ember/cpu_native), PyTorch ops otherwise.

With `residual`, each returns (norm(x + residual), x + residual), the sum rounded to the model dtype
first, exactly as HF computes `residual + hidden_states` and then normalises. `weight` is what the
norm scales by: Llama's w, or Gemma's float32 1 + w.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ember.cpu_native import ops as native
from ember.ops.target import Target
from ember.quant.formats import Fp8Activation, Fp8Layout

NormOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
Fp8NormOutput = Fp8Activation | tuple[Fp8Activation, torch.Tensor]


class NormImpl(Protocol):
    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> NormOutput: ...


class TritonRMSNorm:
    @staticmethod
    def can_implement(target: Target, style: str) -> bool:
        return target.triton

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> NormOutput:
        from ember.kernels import fused_add_rms_norm, rms_norm

        if residual is None:
            return rms_norm(x, weight, eps)
        return fused_add_rms_norm(x, residual, weight, eps)


class TritonFp8RMSNorm:
    """TritonRMSNorm's output already quantized in the layout of the fp8 linear that alone reads it, in
    the same launch (bit for bit the norm, then that linear's quantize): the fp8 decode step of
    Llama-3.1-8B on the H200 quantized right after 64 of its 65 norms, 129 launches in all, 171 us."""

    @staticmethod
    def can_implement(target: Target, style: str) -> bool:
        return target.triton

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, layout: Fp8Layout
    ) -> Fp8NormOutput:
        from ember.kernels import rms_norm_fp8

        out, new_residual = rms_norm_fp8(x, residual, weight, eps, layout)
        return out if new_residual is None else (out, new_residual)


class TorchRMSNorm:
    """Llama's: normalised in float32, rounded to x's dtype, then scaled."""

    @staticmethod
    def can_implement(target: Target, style: str) -> bool:
        return style == "llama"

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> NormOutput:
        if residual is not None:
            x = x + residual
            return _llama_norm(x, weight, eps), x
        return _llama_norm(x, weight, eps)


def _llama_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # the same float32 ops in one call, bit for bit (tests/test_layers.py); in other dtypes it
        # rounds differently from HF
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class TorchGemmaRMSNorm:
    """Gemma's, as transformers computes it: the normalised input times 1 + w, both in float32, rounded to
    x's dtype once at the end (Llama rounds before scaling). The Triton kernels get the float32 1 + w and
    round before scaling, which equals this in float32 only."""

    @staticmethod
    def can_implement(target: Target, style: str) -> bool:
        return style == "gemma"

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> NormOutput:
        if residual is not None:
            x = x + residual
            return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype), x
        return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)


class NativeRMSNorm:
    """One native call for what the PyTorch path does in two or three ops (a decode step makes 61), for
    the rows it takes (`_native_norm_fits`, per call: a QK norm's heads are strided 3-D views); the
    PyTorch formula of the norm's style for the others."""

    @staticmethod
    def can_implement(target: Target, style: str) -> bool:
        return target.native and target.dtype == torch.float32

    def __init__(self, fallback: NormImpl) -> None:
        self.fallback = fallback

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> NormOutput:
        if not _native_norm_fits(x, residual, weight):
            return self.fallback(x, residual, weight, eps)
        if residual is None:
            return native.rms_norm(x, weight, eps)
        return native.add_rms_norm(x, residual, weight, eps)


def _native_norm_fits(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether the native residual add + norm takes these: contiguous float32 [M, N] rows on CPU, a
    float32 weight; other dtypes round as HF does, through the PyTorch ops."""
    return (
        x.dtype == weight.dtype == torch.float32
        and x.dim() == 2
        and x.is_cpu
        and x.is_contiguous()
        and (residual is None or (residual.dtype == torch.float32 and residual.is_contiguous()))
    )
