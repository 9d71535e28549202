"""Linear and embedding layers whose weights stay quantized in memory.

The matmul reads the quantized form on every path: on CUDA, a Triton GEMM that dequantizes in
its inner loop for small batches (decode, bound by weight bandwidth), dequantize-then-cuBLAS for
large ones (compute-bound, where the dequantize pass is amortised), and for fp8 (W8A8) activations
quantized per token and group then a Triton block-scaled fp8 GEMM or `torch._scaled_mm`; on CPU,
PyTorch's packed int8/int4 CPU operators where the format fits them, and an exact emulation of
fp8. The sizes at which the GPU paths switch are measured (benchmarks/quant_gemm.py,
benchmarks/fp8_gemm.py), not guessed.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ember.cpu_native import ops as native
from ember.model.backend import use_triton
from ember.quant.formats import (
    QuantizedWeight,
    codes,
    concat_out,
    dense_weight,
    dequantize,
    same_format,
)
from ember.quant.quantize import quantize, quantize_fp8_activations
from ember.quant.screened_argmax import ScreenedArgmax

if TYPE_CHECKING:
    from ember.kernels.quant_packed import PackedQuantWeight

# Rows at and below which the fused dequantizing GEMM beats dequantize + cuBLAS on an H200
# (benchmarks/results/quant-gemm-cuda-2026-12-02.json: int8 crosses between 64 and 128 rows, int4,
# whose dequantize pass is slower, between 128 and 256).
GPU_FUSED_MAX_ROWS = {"int8": 64, "int4": 128}
# Rows at and below which the packed kernel runs (the rows benchmarks/quant_gemm.py tunes it for);
# above, the packed codes are dequantized for cuBLAS.
PACKED_MAX_ROWS = 64
_TINYGEMM_GROUPS = (32, 64, 128, 256)
_CPU_ACT_DTYPE = torch.bfloat16
# Rows from which cuBLAS's blockwise-scaled `torch._scaled_mm` (1x128 activation, 128x128 weight
# scales) replaces the Triton block-scaled fp8 GEMM; None: Triton at every size. Set from
# benchmarks/fp8_gemm.py on the H200 (fp8-gemm-cuda-2026-12-03.json): from 128 rows cuBLAS wins on
# every 8B shape (256 rows, gate_up: 69.8 us against Triton's 120.3 and bf16's 105.8).
FP8_BLOCK_SCALED_MM_MIN_ROWS: int | None = 128
_SCALED_MM_ROW_MULTIPLE = 16
# Rows at and above which a packed int4 weight is expanded to bf16 for oneDNN's GEMM instead of
# running the int4 kernel, which is compute-bound from a few rows on (it reaches ~70 GMAC/s on this
# project's 2-core AVX-512 EPYC, bf16 GEMM ~150). Summed over one SmolLM2-135M layer in isolation:
# expanding costs 1.8 ms; 128 rows take 6.7 ms through the int4 kernel, 2.8 ms + 1.8 ms expanded;
# 2048 rows 105 ms and 41 ms + 1.8 ms. In the engine, where the expansion no longer runs from cache,
# 128-token prompts were 3-10% slower expanded and 256 and 512 rows 16% and 38% faster.
CPU_EXPAND_MIN_ROWS = 256
_PACK_BLOCK_N = 64
# int4 weights in the native layout take bf16 arithmetic (ember/cpu_native/ops.py, NativeWeight) where the
# CPU has AVX512_BF16: float32 sums of bf16 products, each output rounded to bf16, at every row count.
# False: float32 at every row count, as on other CPUs. Both are consistent from batch to batch; bf16
# doubles the multiply-adds an instruction, which is what prefill and batched decode are bound by
# (default model, `benchmarks/cpu.py`, 2026-12-03: float32 prompt processing 722 tok/s against 1,286-1,646
# in bf16, 16 concurrent streams 268 against 332-414 tok/s). Until then int4 was float32 below 16 rows
# and bf16 above, and a prompt whose first blocks came from the prefix cache answered differently from
# the whole prompt (tests/test_llm_api.py keeps that case).
CPU_INT4_BF16 = True
# Rows from which a native weight is expanded for oneDNN's GEMM (`ops.dequantize`: bf16 or float32, the
# weight's arithmetic) instead of running the native GEMV. `benchmarks/cpu_native_kernels.py`
# (crossover), one SmolLM2-135M layer's int4 weights in cache, 2-core AVX-512 EPYC at load 0.8-1.4,
# native against expanded: in bf16, 16 rows 0.36 / 0.41 ms, 20 rows 0.47-0.51 / 0.44, 24 rows 0.52-0.58
# / 0.47, 32 rows 0.75 / 0.54, 128 2.8 / 1.3; in float32 (the GEMV at the two cores' FMA peak from 8
# rows), 32 rows 0.98-1.03 / 1.86-1.87, 128 3.9-4.0 / 5.4, 256 8.5 / 9.9, 384 14.0 / 14.2, 512
# 19.5-20.2 / 18.2-19.0, 1024 46 / 36. The 49152 x 576 Q8_0 head, whose float32 expansion writes
# 113 MB: 256 rows 104 against 148 ms, 512 282 / 273.
NATIVE_EXPAND_MIN_ROWS = {"bf16": 20, "float32": 512}
# oneDNN keeps state for every row count its GEMM sees (a primitive and its JIT code, ~0.5-1 MB each on
# AMX), so a server whose steps have every row count from 20 to thousands grew without end: the core's
# RSS rose ~6 MiB per 16 requests of random lengths over 30 rounds here, and was flat with every step at
# one shape, or with the native GEMV at every row count. The expanded GEMM therefore runs on rows padded
# up to one of ROW_BUCKETS_PER_OCTAVE sizes per power of two (at most 25% more rows, 12% on average):
# about 35 row counts from 20 to 8192.
ROW_BUCKETS_PER_OCTAVE = 4


def _cpu_layout(w: QuantizedWeight, dtype: torch.dtype) -> tuple[str, tuple[torch.Tensor, ...]]:
    """Pack the weight once for PyTorch's CPU kernels, with bf16 activations: their fp32 paths are
    scalar. Measured on this project's 2-core AVX-512 EPYC, a 1536x576 int4 matmul of 16 rows takes
    12.8 ms with fp32 activations, 0.21 ms with bf16 (fp32 F.linear: 0.31 ms).

    Group-wise int8 (GGUF Q8_0, Q5_K, Q6_K: in practice a model's embedding and LM head) has no CPU
    kernel; it is expanded once to a dense copy in the model dtype, which keeps the file's values
    exactly. Re-quantizing it per channel would save memory but perturbs the logits enough to flip
    near-tied greedy choices of small models. The CPU has no fp8 matmul: fp8 weights (load-time or a
    checkpoint's) run `_fp8_emulated`, the GPU's W8A8 arithmetic reproduced exactly.
    """
    if w.kind == "int8" and w.in_features % 16 == 0 and w.zeros is None and w.group_size == w.in_features:
        return "int8pack", (w.qweight, w.scales[:, 0].to(_CPU_ACT_DTYPE))  # K in 16s, or the kernel crashes
    if w.kind == "int4" and w.group_size in _TINYGEMM_GROUPS and w.out_features % 16 == 0:  # the packing's rule
        # tinygemm computes (q - 8) * scale + zero, so zero = our zero term + 8 * scale. It needs whole
        # groups: a ragged last group is padded, and forward pads x with zeros to match.
        return "int4pack", (_int4pack(w), _scale_zero(w))
    if w.kind == "int8":
        return "dense", (_dense(w, dtype),)
    if w.kind == "fp8":  # no CPU fp8 GEMM: `_fp8_emulated` multiplies the dequantized weight, exact in fp32
        return "fp8emulated", (dequantize(w, torch.float32),)
    return "dequantize", ()


def _native_layout(w: QuantizedWeight) -> native.NativeWeight | None:
    """The native kernels' layout (ember/cpu_native) where they are built and cover the weight; it
    replaces the packed or dense copies `_cpu_layout` would make (int8 codes are shared as they are)."""
    if not (native.fits(w) and native.available()):
        return None
    return native.native_weight(w, bf16=CPU_INT4_BF16 and w.kind == "int4" and native.has_bf16())


def _native_matmul(x: torch.Tensor, w: native.NativeWeight) -> torch.Tensor:
    """x @ W^T in the weight's arithmetic (bf16 or float32) at every row count: the native GEMV below the
    crossover, above it the weight expanded for oneDNN's GEMM."""
    rows = x.shape[0]
    if rows >= native_expand_min_rows(w):
        dense = native.dequantize(w)
        padded = F.pad(x.to(dense.dtype), (0, 0, 0, row_bucket(rows) - rows))
        return F.linear(padded, dense)[:rows].to(x.dtype)
    if x.dtype == torch.float32:
        return native.matmul(x, w)
    return native.matmul(x.float(), w).to(x.dtype)


def row_bucket(rows: int) -> int:
    """`rows` rounded up to the next of ROW_BUCKETS_PER_OCTAVE sizes between two powers of two."""
    step = max(1, (1 << (rows.bit_length() - 1)) // ROW_BUCKETS_PER_OCTAVE)
    return -(-rows // step) * step


def native_expand_min_rows(w: native.NativeWeight) -> int:
    """Rows from which `w` is expanded for oneDNN; below, the native GEMV runs."""
    return NATIVE_EXPAND_MIN_ROWS["bf16" if w.bf16 else "float32"]


def _dense(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """`dense_weight(w, dtype)`, for whole groups in one numpy pass that writes only the result: the
    reference gathers a scale per element and allocates three weight-sized temporaries, 0.29 s of CPU
    time (over half of it page faults) for the default model's 49152x576 Q8_0 embedding."""
    if w.kind != "int8" or w.block_rows != 1 or w.in_perm is not None or w.in_features % w.group_size:
        return dense_weight(w, dtype)
    n, groups = w.scales.shape
    out = torch.empty(n, w.in_features)
    dense = out.numpy().reshape(n, groups, w.group_size)
    np.multiply(w.qweight.numpy().reshape(dense.shape), w.scales.float().numpy()[:, :, None], out=dense, dtype=np.float32)
    if w.zeros is not None:
        dense += w.zeros.float().numpy()[:, :, None]
    return out.to(dtype)


def _scale_zero(w: QuantizedWeight) -> torch.Tensor:
    """tinygemm's (scale, zero + 8 * scale) pairs, bf16 [K / group_size, N, 2], built in float32 by numpy
    with one cast at the end: each torch op on these 30-60k-element arrays took 1-2 ms of CPU time on
    this project's shared 2-core VM (its thread pool waking), 0.45 s of the default model's packing."""
    scales = w.scales.float().numpy().T
    pairs = np.empty((*scales.shape, 2), dtype=np.float32)
    pairs[..., 0] = scales
    np.add(np.float32(0) if w.zeros is None else w.zeros.float().numpy().T, scales * np.float32(8), out=pairs[..., 1])
    return torch.from_numpy(pairs).to(_CPU_ACT_DTYPE)


def _int4pack(w: QuantizedWeight) -> torch.Tensor:
    """The codes in PyTorch's CPU int4 layout. Where that layout is the blocked one `_unpack_int4pack_t`
    reads, numpy writes it straight from the packed codes: 13x less CPU time than unpacking to int32
    for `torch._convert_weight_to_int4pack_for_cpu` on an 8960x1536 weight (4.4 against 58 ms), which
    made up most of the default model's CPU packing at load."""
    if w.out_features % _PACK_BLOCK_N == 0 and w.in_features % 2 == 0 and _padded_k(w) == w.in_features \
            and _int4pack_is_blocked():
        return _int4pack_blocked(w.qweight)
    q = codes(w).to(torch.int32)
    if _padded_k(w) != w.in_features:
        q = F.pad(q, (0, _padded_k(w) - w.in_features))
    return torch._convert_weight_to_int4pack_for_cpu(q, 1)


def _int4pack_blocked(qweight: torch.Tensor) -> torch.Tensor:
    """Ember's packed codes (element 2m low, 2m + 1 high nibble of byte m) -> the blocked layout: per
    64 output rows, byte j of column k holds row j's code k low and row j + 32's high."""
    a = qweight.numpy()
    n, half = a.shape
    rows = a.reshape(n // _PACK_BLOCK_N, 2, _PACK_BLOCK_N // 2, half)
    low, high = rows[:, 0], rows[:, 1]  # [block, j, m]: rows j and j + 32 of each block
    out = np.empty((n // _PACK_BLOCK_N, half, 2, _PACK_BLOCK_N // 2), dtype=np.uint8)  # [block, m, k % 2, j]
    np.bitwise_or(low & 0x0F, high << 4, out=out[:, :, 0].transpose(0, 2, 1))
    np.bitwise_or(low >> 4, high & 0xF0, out=out[:, :, 1].transpose(0, 2, 1))
    return torch.from_numpy(out.reshape(n, half))


def _gpu_layout(w: QuantizedWeight) -> PackedQuantWeight | None:
    """The packed decode layout (ember/kernels/quant_packed.py), made once at load for int4/int8
    weights it covers; it replaces the file's codes, so the weight's memory stays the same."""
    from ember.kernels.quant_packed import pack_weight, packable

    return pack_weight(w) if packable(w) else None


def gpu_matmul(x: torch.Tensor, w: QuantizedWeight, packed: PackedQuantWeight | None) -> torch.Tensor:
    """x @ W^T through Triton: the packed kernel up to PACKED_MAX_ROWS rows, dequantize + cuBLAS above;
    weights without a packed layout take quant_matmul up to GPU_FUSED_MAX_ROWS."""
    from ember.kernels import dequantize_kernel, quant_matmul
    from ember.kernels.quant_packed import dequantize_packed, packed_matmul

    if packed is not None:
        if x.shape[0] <= PACKED_MAX_ROWS:
            return packed_matmul(x, packed)
        return F.linear(x, dequantize_packed(packed, x.dtype))
    if x.shape[0] <= GPU_FUSED_MAX_ROWS[w.kind]:
        return quant_matmul(x, w)
    return F.linear(x, dequantize_kernel(w, x.dtype))


class QuantLinear(nn.Module):
    """y = x @ W^T + b with W quantized. `parts` of different formats (GGUF files mix types inside a
    fused q/k/v) run one matmul each and concatenate; parts of one format are fused into one."""

    def __init__(self, parts: list[QuantizedWeight | torch.Tensor], bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        if len(parts) > 1 and all(isinstance(p, QuantizedWeight) for p in parts) and same_format(parts):
            parts = [concat_out(parts)]
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.out_features = sum(p.out_features if isinstance(p, QuantizedWeight) else p.shape[0] for p in parts)
        on_cpu = _device(parts[0]).type == "cpu"
        self._native = [_native_layout(p) if isinstance(p, QuantizedWeight) and on_cpu else None for p in parts]
        self._cpu = [("native", ()) if nat is not None
                     else _cpu_layout(p, dtype) if isinstance(p, QuantizedWeight) and on_cpu else ("gpu", ())
                     for p, nat in zip(parts, self._native)]
        self._gpu = [_gpu_layout(p) if isinstance(p, QuantizedWeight) and _device(p).type == "cuda" else None
                     for p in parts]
        # A packed copy replaces the codes it was made from: keep only their shape.
        self.parts = [_shape_only(p) if layout in ("int4pack", "dense", "native") or gpu is not None else p
                      for p, (layout, _), gpu in zip(parts, self._cpu, self._gpu)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the decoder's [tokens, features]: no reshapes (2 µs a call of a ~25 µs CPU decode GEMV)
            return self._forward_2d(x)
        shape = x.shape
        return self._forward_2d(x.reshape(-1, shape[-1])).view(*shape[:-1], self.out_features)

    def _forward_2d(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            y = self._matmul(x, self.parts[0], self._cpu[0], self._gpu[0], self._native[0])
        else:
            y = torch.cat([self._matmul(x, *layouts)
                           for layouts in zip(self.parts, self._cpu, self._gpu, self._native)], dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y

    def _matmul(self, x: torch.Tensor, w: QuantizedWeight | torch.Tensor,
                cpu: tuple[str, tuple[torch.Tensor, ...]], gpu: PackedQuantWeight | None,
                nat: native.NativeWeight | None) -> torch.Tensor:
        if not isinstance(w, QuantizedWeight):
            return F.linear(x, w)
        layout, tensors = cpu
        if layout == "dense":
            return F.linear(x, tensors[0])
        if w.in_perm is not None:  # the codes' columns are in act-order (GPTQ desc_act)
            x = x.index_select(1, w.in_perm)
        if nat is not None:
            return _native_matmul(x, nat)
        if w.kind == "fp8":
            return _fp8_matmul(x, w) if use_triton(x) else _fp8_emulated(x, w, *cpu[1])
        if use_triton(x):
            return gpu_matmul(x, w, gpu)
        if layout == "int8pack":
            return torch._weight_int8pack_mm(x.to(_CPU_ACT_DTYPE), *tensors).to(x.dtype)
        if layout == "int4pack":
            padded = x.to(_CPU_ACT_DTYPE)
            if _padded_k(w) != w.in_features:
                padded = F.pad(padded, (0, _padded_k(w) - w.in_features))
            if x.shape[0] >= CPU_EXPAND_MIN_ROWS and w.out_features % _PACK_BLOCK_N == 0 and _int4pack_is_blocked():
                return torch.mm(padded, _expand_int4pack_t(*tensors, w.group_size)).to(x.dtype)
            return torch._weight_int4pack_mm_for_cpu(padded, tensors[0], w.group_size, tensors[1]).to(x.dtype)
        return F.linear(x, dequantize(w, x.dtype))

    def native_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this layer's output, for a fused gate/up projection (rows [0, I) gate,
        [I, 2I) up), in one native call (`ops.matmul_silu`) where the layer is one native weight
        without bias or input permutation and x, float32 [M, K], takes the native GEMV (as `forward`
        would); else None."""
        nat = self.native_gemv_weight()
        if (nat is None or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous()
                or x.shape[0] >= native_expand_min_rows(nat)):
            return None
        return native.matmul_silu(x, nat)

    def native_gemv_weight(self) -> native.NativeWeight | None:
        """The layer's one native weight when `forward` is exactly its GEMV (no bias, no input permutation,
        one part), for callers that fuse it with other native ops (ops.decode_layer); else None."""
        parts = self.native_gemv_parts()
        return parts[0] if parts is not None and parts[1] is None else None

    def native_gemv_parts(self) -> tuple[native.NativeWeight, torch.Tensor | None] | None:
        """(native weight, float32 bias or None) when `forward` is exactly that GEMV plus the bias (one part,
        no input permutation); else None."""
        if len(self.parts) != 1 or self._native[0] is None or self.parts[0].in_perm is not None:
            return None
        if self.bias is not None and self.bias.dtype != torch.float32:
            return None
        return self._native[0], None if self.bias is None else self.bias.detach()

    def cpu_dense_weight(self) -> torch.Tensor | None:
        """The whole weight when it is one part kept as a dense CPU copy, else None."""
        if len(self._cpu) == 1 and self._cpu[0][0] == "dense":
            return self._cpu[0][1][0]
        return None

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor the weight occupies (codes, scales, zeros, dense parts, CPU-packed copies), for
        memory accounting."""
        tensors = [t for p in self.parts for t in (p.tensors() if isinstance(p, QuantizedWeight) else [p])]
        return (tensors + [t for _, packed in self._cpu for t in packed]
                + [t for packed in self._gpu if packed is not None for t in packed.tensors()]
                + [t for nat in self._native if nat is not None for t in nat.tensors()])


def _unpack_int4pack_t(packed: torch.Tensor) -> torch.Tensor:
    """The codes of a CPU-packed int4 weight as uint8 [K, N]. PyTorch's AVX-512 packing stores each
    block of 64 output rows as [K, 32] bytes, row j of the block in the low nibble of byte j and row
    j + 32 in the high one (checked once at run time by `_int4pack_is_blocked`)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    blocks = packed.view(n // _PACK_BLOCK_N, k, _PACK_BLOCK_N // 2)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).transpose(0, 1).reshape(k, n)


@functools.cache
def _int4pack_is_blocked() -> bool:
    """Whether this PyTorch build packs int4 weights as `_unpack_int4pack_t` reads them; other
    layouts keep to the int4 kernel at every size."""
    q = torch.randint(0, 16, (2 * _PACK_BLOCK_N, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed.shape == (q.shape[0], q.shape[1] // 2) and torch.equal(_unpack_int4pack_t(packed).t(), q.byte())


def _expand_int4pack_t(packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """W^T as bf16 [K, N] from the packed codes and tinygemm's (scale, zero) pairs, computed as
    q * scale + (zero - 8 * scale) in float32. Transposed because the packing's blocks are runs of
    output rows: laying them side by side copies 64 codes at a time."""
    codes_t = _unpack_int4pack_t(packed)
    k, n = codes_t.shape
    scale, zero = scale_zero.float().unbind(-1)  # [K / group_size, N] each
    w = codes_t.view(k // group_size, group_size, n).float().mul_(scale[:, None]).add_((zero - 8 * scale)[:, None])
    return w.view(k, n).to(_CPU_ACT_DTYPE)


def _padded_k(w: QuantizedWeight) -> int:
    """K rounded up to whole groups."""
    return -(-w.in_features // w.group_size) * w.group_size


def _shape_only(w: QuantizedWeight) -> QuantizedWeight:
    empty = torch.empty(w.out_features, 0)
    return QuantizedWeight(w.kind, empty.to(w.qweight.dtype), empty, None, w.group_size, w.in_features,
                           w.block_rows, w.in_perm)


def _device(p: QuantizedWeight | torch.Tensor) -> torch.device:
    return (p.qweight if isinstance(p, QuantizedWeight) else p).device


def _fp8_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """W8A8: x gets dynamic scales per token and group of the weight's group size (128 inputs for a
    block-scaled weight, all K for a per-channel one). Per-channel weights go to cuBLAS's row-wise
    `torch._scaled_mm`; block-scaled ones to the Triton block GEMM, or from
    FP8_BLOCK_SCALED_MM_MIN_ROWS rows to cuBLAS's blockwise one. The model runner refuses fp8 weights
    on CUDA devices without fp8 tensor cores, at load."""
    from ember.kernels import fp8_block_matmul, quantize_fp8_groups

    x = x.contiguous()
    if w.block_rows == 1 and w.group_size == w.in_features:
        xq, x_scales = quantize_fp8_groups(x, w.group_size)
        return torch._scaled_mm(xq, w.qweight.t(), scale_a=x_scales, scale_b=w.scales.t(), out_dtype=x.dtype)
    if _block_scaled_mm_fits(x.shape[0], w):
        return _blockwise_scaled_mm(x, w)
    xq, x_scales = quantize_fp8_groups(x, w.group_size)
    return fp8_block_matmul(xq, x_scales, w, x.dtype)


def _blockwise_scaled_mm(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """cuBLAS's blockwise-scaled GEMM, x's rows padded to a multiple of 16: on the H200 (CUDA 13) cuBLAS has
    no algorithm for some row counts (1 row; the offline workload's ragged batches failed too), and every
    multiple of 16 benchmarks/fp8_gemm.py tried ran."""
    from ember.kernels import quantize_fp8_groups

    rows = x.shape[0]
    pad = -rows % _SCALED_MM_ROW_MULTIPLE
    padded = F.pad(x, (0, 0, 0, pad)) if pad else x  # F.pad copies even when it adds nothing: 0.29 ms a 256-row 8B step
    xq, x_scales = quantize_fp8_groups(padded, w.group_size, column_major_scales=True)
    out = torch._scaled_mm(xq, w.qweight.t(), scale_a=x_scales, scale_b=w.scales.t(), out_dtype=x.dtype)
    return out[:rows]


def _block_scaled_mm_fits(rows: int, w: QuantizedWeight) -> bool:
    """cuBLAS's blockwise scaling takes 128x128 weight blocks over whole blocks only."""
    return (FP8_BLOCK_SCALED_MM_MIN_ROWS is not None and rows >= FP8_BLOCK_SCALED_MM_MIN_ROWS
            and w.group_size == w.block_rows == 128 and w.in_features % 128 == 0 and w.out_features % 128 == 0)


def _fp8_emulated(x: torch.Tensor, w: QuantizedWeight, dense: torch.Tensor) -> torch.Tensor:
    """fp8 on CPU, exactly as the GPU computes it up to fp32 summation order: x's e4m3 codes and scales
    (per token and group) times the dequantized weight, both exact in fp32. For measuring quality
    (benchmarks/quality.py) and tests; each step dequantizes x, so it is slow."""
    xq, x_scales = quantize_fp8_activations(x, w.group_size)
    groups = torch.arange(w.in_features, device=x.device) // w.group_size
    return F.linear(xq.float() * x_scales[:, groups], dense).to(x.dtype)


class QuantEmbedding(nn.Module):
    """Token embedding that dequantizes only the rows it looks up; with tied weights it also serves
    as the LM head through `attend`, and finds greedy tokens through `argmax`."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, tied: bool) -> None:
        super().__init__()
        self.weight_q = weight
        self.dtype = dtype
        self.head = QuantLinear([weight], None, dtype) if tied else None
        dense = self.head.cpu_dense_weight() if self.head is not None else None
        self.screen = ScreenedArgmax(dense) if dense is not None and dense.dtype == torch.float32 else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight_q
        scale_rows = ids // w.block_rows
        rows = QuantizedWeight(w.kind, w.qweight[ids], w.scales[scale_rows],
                               None if w.zeros is None else w.zeros[scale_rows], w.group_size, w.in_features)
        return dequantize(rows, self.dtype)

    def attend(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The token `attend` scores highest per row, without every float32 logit where a screen exists."""
        if self.screen is not None:
            return self.screen(hidden)
        return self.attend(hidden).argmax(dim=-1)

    def weight_tensors(self) -> list[torch.Tensor]:
        head = self.head.weight_tensors() if self.head is not None else []
        return self.weight_q.tensors() + head + (self.screen.tensors() if self.screen is not None else [])


def quantize_module(module: nn.Module, method: str, dtype: torch.dtype, tied: bool) -> nn.Module:
    """The quantized replacement of a dense nn.Linear or nn.Embedding (its float weight is dropped);
    a `tied` embedding also serves as the LM head. `method` is a `--quantization` method."""
    if isinstance(module, nn.Embedding):
        return QuantEmbedding(quantize(module.weight.data, method), dtype, tied)
    return QuantLinear([quantize(module.weight.data, method)], module.bias, dtype)
