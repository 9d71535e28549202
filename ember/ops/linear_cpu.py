"""Quantized matmuls on CPU through PyTorch's operators, where the native kernels (linear_native) do
not run: PyTorch's packed int8/int4 CPU operators where the format fits them, a dense copy for
group-wise int8, and an exact emulation of fp8.

Each weight is packed once at load for PyTorch's CPU kernels, with bf16 activations: their fp32 paths
are scalar. Measured on this project's 2-core AVX-512 EPYC, a 1536x576 int4 matmul of 16 rows takes
12.8 ms with fp32 activations, 0.21 ms with bf16 (fp32 F.linear: 0.31 ms).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from ember.ops.target import Target
from ember.quant.formats import QuantizedWeight, codes, dense_weight, dequantize, shape_only
from ember.quant.quantize import quantize_fp8_activations

_TINYGEMM_GROUPS = (32, 64, 128, 256)
_CPU_ACT_DTYPE = torch.bfloat16
# Rows at and above which a packed int4 weight is expanded to bf16 for oneDNN's GEMM instead of
# running the int4 kernel, which is compute-bound from a few rows on (it reaches ~70 GMAC/s on this
# project's 2-core AVX-512 EPYC, bf16 GEMM ~150). Summed over one SmolLM2-135M layer in isolation:
# expanding costs 1.8 ms; 128 rows take 6.7 ms through the int4 kernel, 2.8 ms + 1.8 ms expanded;
# 2048 rows 105 ms and 41 ms + 1.8 ms. In the engine, where the expansion no longer runs from cache,
# 128-token prompts were 3-10% slower expanded and 256 and 512 rows 16% and 38% faster.
CPU_EXPAND_MIN_ROWS = 256
_PACK_BLOCK_N = 64


class Int8PackLinear:
    """Per-channel int8 through `torch._weight_int8pack_mm`."""

    layout = "int8pack"
    permutes_input = True

    @staticmethod
    def can_implement(target: Target, w: QuantizedWeight) -> bool:
        # K in 16s, or the kernel crashes
        return (
            target.cpu
            and w.kind == "int8"
            and w.in_features % 16 == 0
            and w.zeros is None
            and w.group_size == w.in_features
        )

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        self.weight = w
        self.packed = (w.qweight, w.scales[:, 0].to(_CPU_ACT_DTYPE))

    def tensors(self) -> list[torch.Tensor]:
        return list(self.packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(_CPU_ACT_DTYPE), *self.packed).to(x.dtype)


class Int4PackLinear:
    """int4 through PyTorch's tinygemm CPU kernel, which computes (q - 8) * scale + zero, so zero = our
    zero term + 8 * scale. It needs whole groups: a ragged last group is padded, and x with zeros to
    match. From CPU_EXPAND_MIN_ROWS rows the weight is expanded to bf16 for oneDNN's GEMM instead."""

    layout = "int4pack"
    permutes_input = True

    @staticmethod
    def can_implement(target: Target, w: QuantizedWeight) -> bool:
        # the packing's rule
        return target.cpu and w.kind == "int4" and w.group_size in _TINYGEMM_GROUPS and w.out_features % 16 == 0

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        self.weight = shape_only(w)  # the packed copy replaces the codes it was made from
        self.packed = (_int4pack(w), _scale_zero(w))
        self.group_size = w.group_size
        self.pad = _padded_k(w) - w.in_features
        blocked = w.out_features % _PACK_BLOCK_N == 0 and _int4pack_is_blocked()
        self.expand_min_rows = CPU_EXPAND_MIN_ROWS if blocked else math.inf  # other layouts: the kernel always

    def tensors(self) -> list[torch.Tensor]:
        return list(self.packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        padded = x.to(_CPU_ACT_DTYPE)
        if self.pad:
            padded = F.pad(padded, (0, self.pad))
        if x.shape[0] >= self.expand_min_rows:
            return torch.mm(padded, _expand_int4pack_t(*self.packed, self.group_size)).to(x.dtype)
        return torch._weight_int4pack_mm_for_cpu(padded, self.packed[0], self.group_size, self.packed[1]).to(x.dtype)


class DenseInt8Linear:
    """Group-wise int8 (GGUF Q8_0, Q5_K, Q6_K: in practice a model's embedding and LM head) has no CPU
    kernel; it is expanded once to a dense copy in the model dtype, which keeps the file's values
    exactly. Re-quantizing it per channel would save memory but perturbs the logits enough to flip
    near-tied greedy choices of small models."""

    layout = "dense"
    permutes_input = False  # the copy's columns are in input order

    @staticmethod
    def can_implement(target: Target, w: QuantizedWeight) -> bool:
        return target.cpu and w.kind == "int8"

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        self.weight = shape_only(w)
        self.dense = _dense(w, dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.dense]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense)


class Fp8EmulatedLinear:
    """The CPU has no fp8 matmul: fp8 weights (load-time or a checkpoint's) run the GPU's W8A8
    arithmetic reproduced exactly, up to fp32 summation order: x's e4m3 codes and scales (per token and
    group) times the dequantized weight, both exact in fp32. For measuring quality
    (benchmarks/quality.py) and tests; each step dequantizes x, so it is slow."""

    layout = "fp8emulated"
    permutes_input = True

    @staticmethod
    def can_implement(target: Target, w: QuantizedWeight) -> bool:
        return target.cpu and w.kind == "fp8"

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        self.weight = w
        self.dense = dequantize(w, torch.float32)

    def tensors(self) -> list[torch.Tensor]:
        return [self.dense]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        xq, x_scales = quantize_fp8_activations(x, w.group_size)
        groups = torch.arange(w.in_features, device=x.device) // w.group_size
        return F.linear(xq.float() * x_scales[:, groups], self.dense).to(x.dtype)


# PyTorch's CPU implementations, in the order the registry tries them after the native kernels.
TORCH_CPU_LINEARS = (Int8PackLinear, Int4PackLinear, DenseInt8Linear, Fp8EmulatedLinear)
_CPU = Target(torch.device("cpu"), torch.float32, triton=False, native=False)


def _cpu_layout(w: QuantizedWeight, dtype: torch.dtype) -> tuple[str, tuple[torch.Tensor, ...]]:
    """The layout PyTorch's CPU operators get for `w` (the native kernels aside), as its name and
    tensors: "dequantize" (none) where no operator fits."""
    cls = next((cls for cls in TORCH_CPU_LINEARS if cls.can_implement(_CPU, w)), None)
    if cls is None:
        return "dequantize", ()
    return cls.layout, tuple(cls(w, dtype).tensors())


def _dense(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """`dense_weight(w, dtype)`, for whole groups in one numpy pass that writes only the result: the
    reference gathers a scale per element and allocates three weight-sized temporaries, 0.29 s of CPU
    time (over half of it page faults) for the default model's 49152x576 Q8_0 embedding."""
    if w.kind != "int8" or w.block_rows != 1 or w.in_perm is not None or w.in_features % w.group_size:
        return dense_weight(w, dtype)
    n, groups = w.scales.shape
    out = torch.empty(n, w.in_features)
    dense = out.numpy().reshape(n, groups, w.group_size)
    np.multiply(
        w.qweight.numpy().reshape(dense.shape), w.scales.float().numpy()[:, :, None], out=dense, dtype=np.float32
    )
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
    if (
        w.out_features % _PACK_BLOCK_N == 0
        and w.in_features % 2 == 0
        and _padded_k(w) == w.in_features
        and _int4pack_is_blocked()
    ):
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
