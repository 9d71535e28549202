"""Quantized matmuls through Triton: a GEMM that dequantizes in its inner loop for small batches (decode,
bound by weight bandwidth), dequantize-then-cuBLAS for large ones (compute-bound, where the dequantize
pass is amortised), and for fp8 (W8A8) activations quantized per token and group then a Triton
block-scaled fp8 GEMM or `torch._scaled_mm`. The sizes at which they switch are measured
(benchmarks/quant_gemm.py, benchmarks/fp8_gemm.py), not guessed.

The Triton kernels are imported where they are called, so CPU-only paths never import Triton.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ember.ops.target import Target
from ember.quant.formats import Fp8Activation, Fp8Layout, QuantizedWeight, shape_only

if TYPE_CHECKING:
    from ember.kernels.quant_packed import PackedQuantWeight

# Rows at and below which the fused dequantizing GEMM beats dequantize + cuBLAS on an H200
# (benchmarks/results/quant-gemm-cuda-2026-12-02.json: int8 crosses between 64 and 128 rows, int4,
# whose dequantize pass is slower, between 128 and 256).
GPU_FUSED_MAX_ROWS = {"int8": 64, "int4": 128}
# Rows at and below which the packed kernel runs (the rows benchmarks/quant_gemm.py tunes it for);
# above, the packed codes are dequantized for cuBLAS.
PACKED_MAX_ROWS = 64
# Rows from which cuBLAS's blockwise-scaled `torch._scaled_mm` (1x128 activation, 128x128 weight
# scales) replaces the Triton block-scaled fp8 GEMM; None: Triton at every size. Set from
# benchmarks/fp8_gemm.py on the H200 (fp8-gemm-cuda-2026-12-03.json): from 128 rows cuBLAS wins on
# every 8B shape (256 rows, gate_up: 69.8 us against Triton's 120.3 and bf16's 105.8).
FP8_BLOCK_SCALED_MM_MIN_ROWS: int | None = 128
_SCALED_MM_ROW_MULTIPLE = 16


class TritonPackedLinear:
    """The packed decode layout (ember/kernels/quant_packed.py), made once at load for the int4/int8
    CUDA weights it covers; it replaces the file's codes, so the weight's memory stays the same. The
    packed kernel up to PACKED_MAX_ROWS rows, dequantize + cuBLAS above."""

    permutes_input = True

    @staticmethod
    def can_implement(target: Target, w: QuantizedWeight) -> bool:
        if not (target.triton and target.device.type == "cuda" and w.kind in GPU_FUSED_MAX_ROWS):
            return False
        from ember.kernels.quant_packed import packable

        return packable(w)

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        from ember.kernels.quant_packed import pack_weight

        self.packed = pack_weight(w)
        self.weight = shape_only(w)

    def tensors(self) -> list[torch.Tensor]:
        return self.packed.tensors()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_matmul(x, self.packed)


class TritonQuantLinear:
    """int4/int8 weights without a packed layout: quant_matmul up to GPU_FUSED_MAX_ROWS, dequantize +
    cuBLAS above."""

    permutes_input = True

    @staticmethod
    def can_implement(target: Target, w: QuantizedWeight) -> bool:
        return target.triton and w.kind in GPU_FUSED_MAX_ROWS

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        self.weight = w

    def tensors(self) -> list[torch.Tensor]:
        return []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _fused_matmul(x, self.weight)


def gpu_matmul(x: torch.Tensor, w: QuantizedWeight, packed: PackedQuantWeight | None) -> torch.Tensor:
    """x @ W^T through Triton, as TritonPackedLinear (given `packed`) or TritonQuantLinear computes it."""
    return _fused_matmul(x, w) if packed is None else _packed_matmul(x, packed)


def _packed_matmul(x: torch.Tensor, packed: PackedQuantWeight) -> torch.Tensor:
    from ember.kernels.quant_packed import dequantize_packed, packed_matmul

    if x.shape[0] <= PACKED_MAX_ROWS:
        return packed_matmul(x, packed)
    return F.linear(x, dequantize_packed(packed, x.dtype))


def _fused_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    from ember.kernels import dequantize_kernel, quant_matmul

    if x.shape[0] <= GPU_FUSED_MAX_ROWS[w.kind]:
        return quant_matmul(x, w)
    return F.linear(x, dequantize_kernel(w, x.dtype))


class Fp8Linear(ABC):
    """W8A8: x quantized per token and group (`fp8_layout`, for the rows at hand), then an fp8 GEMM.
    Called on x itself, or on x already quantized in that layout (an Fp8Activation) by the norm or
    activation that produced it (ember/ops/norm.py, activation.py), which saves the quantize launch."""

    permutes_input = True

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        self.weight = w

    def tensors(self) -> list[torch.Tensor]:
        return []

    def fp8_layout(self, rows: int) -> Fp8Layout:
        return Fp8Layout(self.weight.group_size)

    def __call__(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            from ember.kernels import quantize_fp8

            x = quantize_fp8(x.contiguous(), self.fp8_layout(x.shape[0]))
        return self.matmul(x)

    @abstractmethod
    def matmul(self, x: Fp8Activation) -> torch.Tensor: ...


class TritonFp8ChannelLinear(Fp8Linear):
    """W8A8 for per-channel fp8 weights: x gets dynamic scales per token (a group of all K), then
    cuBLAS's row-wise `torch._scaled_mm`. The model runner refuses fp8 weights on CUDA devices without
    fp8 tensor cores, at load."""

    @staticmethod
    def can_implement(target: Target, w: QuantizedWeight) -> bool:
        return target.triton and w.kind == "fp8" and w.block_rows == 1 and w.group_size == w.in_features

    def matmul(self, x: Fp8Activation) -> torch.Tensor:
        return _scaled_mm(x, self.weight)


class TritonFp8BlockLinear(Fp8Linear):
    """W8A8 for block-scaled fp8 weights: x gets dynamic scales per token and group of 128 inputs, then
    the Triton block GEMM, or from FP8_BLOCK_SCALED_MM_MIN_ROWS rows cuBLAS's blockwise one."""

    @staticmethod
    def can_implement(target: Target, w: QuantizedWeight) -> bool:
        return target.triton and w.kind == "fp8"

    def fp8_layout(self, rows: int) -> Fp8Layout:
        """cuBLAS's blockwise GEMM reads column-major scales, and has no algorithm for some row counts
        on the H200 (CUDA 13: 1 row; the offline workload's ragged batches failed too), while every
        multiple of 16 benchmarks/fp8_gemm.py tried ran: its rows come padded to a multiple of 16, by the
        quantizing kernel itself (an F.pad before it copied x: 0.29 ms a 256-row 8B step)."""
        if _block_scaled_mm_fits(rows, self.weight):
            return Fp8Layout(self.weight.group_size, column_major_scales=True, row_multiple=_SCALED_MM_ROW_MULTIPLE)
        return Fp8Layout(self.weight.group_size)

    def matmul(self, x: Fp8Activation) -> torch.Tensor:
        if x.layout.column_major_scales:
            return _scaled_mm(x, self.weight)[: x.rows]
        from ember.kernels import fp8_block_matmul

        return fp8_block_matmul(x.codes, x.scales, self.weight, x.dtype)


def _scaled_mm(x: Fp8Activation, w: QuantizedWeight) -> torch.Tensor:
    """cuBLAS's fp8 GEMM, row-wise or blockwise as the scales' shapes say."""
    return torch._scaled_mm(x.codes, w.qweight.t(), scale_a=x.scales, scale_b=w.scales.t(), out_dtype=x.dtype)


def _block_scaled_mm_fits(rows: int, w: QuantizedWeight) -> bool:
    """cuBLAS's blockwise scaling takes 128x128 weight blocks over whole blocks only."""
    return (
        FP8_BLOCK_SCALED_MM_MIN_ROWS is not None
        and rows >= FP8_BLOCK_SCALED_MM_MIN_ROWS
        and w.group_size == w.block_rows == 128
        and w.in_features % 128 == 0
        and w.out_features % 128 == 0
    )
