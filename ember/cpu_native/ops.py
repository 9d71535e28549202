"""Typed wrappers around the native CPU kernels (kernels.c): shape and dtype checks with clear
errors, output allocation, and the weight layout the GEMVs read.

The kernels are built on first use (or at install by `python -m ember.cpu_native.build`) and cached;
when there is no compiler, the build fails, or EMBER_CPU_NATIVE=0 is set, `available()` is False
and callers keep their PyTorch paths. One log line says which.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from ember.quant.formats import INT5_RUN, QuantizedWeight, code_bytes

logger = logging.getLogger("ember")

_CHUNK = {"int4": 32, "int5": INT5_RUN, "int8": 16}  # inputs per vector step of each kernel
_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_BITS = {"int4": 4, "int5": 5, "int8": 8}  # the kernels' name for a layout
_BF16 = 16  # gemv.c's BF16: `bits | _BF16` names a layout in bf16 arithmetic
# (kind, bf16) -> the kernels' GEMV, GEMV + SiLU and dense expansion of that layout and arithmetic (int5's
# and int8's bf16 arithmetic multiplies the codes exactly, so their expansion is the float32 one)
_KERNELS = {
    (kind, bf16): (
        f"gemv_q{bits}{suffix}",
        f"gemv_silu_q{bits}{suffix}",
        f"dequantize_q{bits}_{'bf16' if bf16 and kind == 'int4' else 'f32'}",
    )
    for kind, bits in _BITS.items()
    for bf16, suffix in ((False, ""), (True, "_bf16"))
}
_MAX_GROUP_DIM = 8192  # kernels.c MAX_ACC: query heads per KV head times head dim
_MAX_BLOCK = 256


def load_kernels() -> ModuleType | None:
    """Builds (or finds in the cache) and loads the kernels; None, with one warning, when that fails."""
    from ember.cpu_native.build import BuildError, build, load

    try:
        return load(build())
    except (BuildError, ImportError, OSError) as e:
        logger.warning("CPU native kernels unavailable, using PyTorch ops instead: %s", e)
        return None


kernels = functools.cache(load_kernels)  # the loaded module (or None), built once per process


@functools.cache
def _note(message: str) -> None:
    logger.info(message)


def available() -> bool:
    """Whether the native kernels run (EMBER_CPU_NATIVE is read on every call, so it applies to the next
    model load): "0" never; unset, where they were built with AVX-512 (the plain-C build, for other CPUs,
    is correct but not tuned, and PyTorch's own kernels are vectorized there); "1" whenever they build."""
    flag = os.environ.get("EMBER_CPU_NATIVE", "")
    if flag == "0":
        _note("EMBER_CPU_NATIVE=0: CPU native kernels disabled, using PyTorch ops")
        return False
    module = kernels()
    if module is None:
        return False
    if flag != "1" and module.simd() != "avx512":
        _note("CPU without AVX-512: using PyTorch ops (EMBER_CPU_NATIVE=1 runs the plain-C kernels)")
        return False
    return True


def _module() -> ModuleType:
    module = kernels()
    if module is None:  # only when a caller skipped available()
        raise RuntimeError("the CPU native kernels are not available (see ember.cpu_native.ops.available)")
    return module


@dataclass
class NativeWeight:
    """A quantized weight in the layout the GEMVs read: int4 codes as 16-byte runs of 32 inputs (input
    j in the low nibble of byte j, j + 16 in the high one), int5 codes as those runs after 4 bytes of
    fifth bits (int8 codes in [-16, 15] without zeros, as GGUF Q5_0 holds them: w = (q - 16) * scale),
    int8 codes row-major as stored; scales (and zeros) [N, ceil(K / group_size)]: GGUF K-quants' in their
    two-level form (uint8 bytes: int8 codes [N, G], then float16 bases per 256 inputs; kernels.h, param),
    others float16 where that holds them exactly, else float32; w = q * scale + zero.

    `bf16` (CPUs with AVX512_BF16; weights without zeros but int4) fixes the weight's arithmetic at every
    row count: x rounded to bf16, bf16 products, float32 sums. int4's w = q * scale + zero is rounded to
    bf16 and its outputs too, as oneDNN's bf16 GEMM computes; int5's and int8's codes are exact in bf16 and
    each group's float32 sum is multiplied by its scale, so they differ from float32 arithmetic only by
    x's rounding. Else float32. One arithmetic per weight, whatever the batch, is what lets a prompt's
    tail computed after a prefix-cache hit see the numbers the whole prompt would."""

    kind: str  # "int4", "int5" or "int8"
    codes: torch.Tensor  # uint8 [N, K / 2] (int4), uint8 [N, K / 32 * 20] (int5) or int8 [N, K]
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    in_features: int
    bf16: bool = False

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def dense_dtype(self) -> torch.dtype:
        """The dtype of `dequantize(self)`: bf16 for int4 in bf16 arithmetic, else float32 (exact)."""
        return torch.bfloat16 if self.bf16 and self.kind == "int4" else torch.float32

    @property
    def param_mode(self) -> int:
        """How the kernels read scales and zeros (kernels.h, param): 0 float32, 1 float16, 2 two-level."""
        return 2 if self.scales.dtype == torch.uint8 else int(self.scales.dtype == torch.float16)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scales, self.zeros) if t is not None]


def fits(w: QuantizedWeight) -> bool:
    """Whether the kernels cover the weight: int4 or int8 on CPU, groups and K in runs of the kernel's
    vector step (int8 per channel included; a shorter last group too, as `quantize_int4` makes for a K
    below its group size), one scale row per output row. GGUF Q2_K's int4 groups of 16 do not (PyTorch runs
    them); the kernels themselves refuse such groups and K with a ValueError (gemv.c, layout_fits)."""
    chunk = _CHUNK.get(w.kind)
    return (
        chunk is not None
        and w.qweight.device.type == "cpu"
        and w.block_rows == 1
        and w.group_size % chunk == 0
        and w.in_features % chunk == 0
        and w.scales.shape == (w.out_features, -(-w.in_features // w.group_size))
    )


def bf16_fits(w: QuantizedWeight) -> bool:
    """Whether `w` can take bf16 arithmetic (`native_weight(w, bf16=True)`): a CPU with AVX512_BF16, and
    int4, or int5 or int8 without zeros (a zero would add a group's sum of x to each output: not implemented)."""
    zero_free = w.kind in ("int5", "int8") and w.zeros is None and w.in_features % 32 == 0
    return has_bf16() and (w.kind == "int4" or zero_free)


def native_weight(w: QuantizedWeight, bf16: bool = False) -> NativeWeight:
    """The native layout of `w` (which must fit), in bf16 arithmetic if asked (where `bf16_fits(w)`).
    int4 codes are re-laid out (the same bytes, which replace the file's), int8 codes in [-16, 15] without
    zeros packed to int5; int5 codes (GGUF Q5_0's, kept as read) and other int8 codes are shared with `w`
    when contiguous, so a tied LM head costs only its float16 scales beside its embedding. A `runs` weight
    (GGUF Q4_1) is already that layout: the default model's 120 matrices took 0.13 s of CPU to go from the
    file's runs to Ember's packing and back (2-core EPYC, 2026-12-07)."""
    if not fits(w):
        raise ValueError(
            f"{w.kind} weight with groups of {w.group_size} over K={w.in_features} (block rows "
            f"{w.block_rows}) does not fit the CPU native kernels"
        )
    if bf16 and not bf16_fits(w):
        raise ValueError(f"bf16 arithmetic needs an int4 or zero-free int8 weight (got {w.kind}) and AVX512_BF16")
    if w.runs:  # the layout and float16 parameters the kernels read, as the file stored them
        codes, scales = w.qweight.contiguous(), w.scales.contiguous()
        zeros = None if w.zeros is None else w.zeros.contiguous()
        return NativeWeight("int4", codes, scales, zeros, w.group_size, w.in_features, bf16)
    scales, zeros = _two_level_params(w) or _compact_params(w.scales, w.zeros)
    if w.kind == "int8":
        five = _pack_int5(w) if zeros is None else None
        if five is not None:
            return NativeWeight("int5", five, scales, None, w.group_size, w.in_features, bf16)
    if w.kind in ("int5", "int8"):
        return NativeWeight(w.kind, w.qweight.contiguous(), scales, zeros, w.group_size, w.in_features, bf16)
    return NativeWeight(
        w.kind, _relayout_int4(w.qweight, w.in_features), scales, zeros, w.group_size, w.in_features, bf16
    )


def _pack_int5(w: QuantizedWeight) -> torch.Tensor | None:
    """int8 codes that all lie in [-16, 15] as int5 runs, else None: MXFP4's, say (GGUF Q5_0 arrives as
    int5). A Qwen2-0.5B Q4_K_M file is 64% Q5_0 by weight: in int8 a decode step read 545 MB against
    llama.cpp's 395 (issue 30)."""
    if w.group_size % INT5_RUN or w.in_features % INT5_RUN:
        return None
    codes = w.qweight.contiguous()
    out = torch.empty(w.out_features, code_bytes("int5", w.in_features), dtype=torch.uint8)
    n, k = codes.shape
    if not _module().pack_q5(codes.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads()):
        return None
    return out


def _two_level_params(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A K-quant's scales and zeros in the kernels' two-level form (kernels.h, param), where the weight
    carries its ScaleFactors, K is whole super-blocks and they rebuild `scales` and `zeros` bit for bit;
    else None. Q4_K in float32 read 6.5 bits a weight, this 4.625 (llama.cpp's Q4_K: 4.5)."""
    f = w.factors
    if f is None or w.in_features % 256 or w.group_size not in (16, 32) or f.per * w.group_size != 256:
        return None
    packed = [_two_level(w.scales, f.scale_base, f.scale_codes, f.per)]
    if w.zeros is not None:
        packed.append(_two_level(w.zeros, f.zero_base, f.zero_codes, f.per))
    if any(p is None for p in packed):
        return None
    return packed[0], packed[1] if len(packed) > 1 else None  # type: ignore[return-value]


def _two_level(
    values: torch.Tensor, base: torch.Tensor | None, codes: torch.Tensor | None, per: int
) -> torch.Tensor | None:
    """int8 codes then float16 bases in one byte buffer, if base * codes gives `values` bit for bit."""
    if base is None or codes is None:
        return None
    half = base.half()
    if not torch.equal(half.float().repeat_interleave(per, dim=1) * codes.float(), values):
        return None
    count = codes.numel()
    packed = torch.zeros(count + count % 2 + 2 * half.numel(), dtype=torch.uint8)
    packed[:count] = codes.contiguous().view(torch.uint8).reshape(-1)
    packed[count + count % 2 :] = half.contiguous().view(torch.uint8).reshape(-1)
    return packed


def _compact_params(scales: torch.Tensor, zeros: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales and zeros as float16 when that is exact (GGUF Q4_0/Q4_1/Q5_0/Q8_0 store float16 d and m):
    for Q4_1 groups of 32 they are a third of the bytes a step reads in float32 (8 of 24 per group), for a
    Q8_0 LM head 1 of 9 bits a weight. K-quants' d * sc products stay float32. In torch, not numpy: the
    default model's 120 weights in 11-13 ms against 40-50 at load (2-core EPYC, 2026-12-07)."""
    parts = [t.float().contiguous() for t in (scales, zeros) if t is not None]
    halves = [p.half() for p in parts]
    if not all(torch.equal(h.float(), p) for h, p in zip(halves, parts)):
        return parts[0], parts[1] if zeros is not None else None
    return halves[0], halves[1] if zeros is not None else None


def _relayout_int4(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """Ember's packing (input 2m low, 2m + 1 high nibble of byte m) -> runs of 32: byte j of a run holds
    inputs j (low) and j + 16 (high). A run's 16 bytes as two 64-bit words L (inputs 0-15) and H (16-31):
    output byte 2i is the low nibbles of byte i of L and of H, byte 2i + 1 their high nibbles, so four
    word operations and two byte interleaves do it without unpacking to one input per byte: the default
    model's 210 int4 weights in 0.054 s of CPU against 0.134-0.142 s unpacking first (first touch of
    the memory included, as at load; 2-core EPYC, 2026-12-05)."""
    n = qweight.shape[0]
    words = np.ascontiguousarray(qweight.numpy()).view(np.uint64).reshape(n, in_features // 32, 2)
    low, high = words[:, :, 0], words[:, :, 1]
    out = np.empty((n, in_features // 32, 8, 2), dtype=np.uint8)
    out[..., 0] = ((low & _LOW_NIBBLES) | ((high & _LOW_NIBBLES) << np.uint64(4))).view(np.uint8).reshape(n, -1, 8)
    out[..., 1] = (((low >> np.uint64(4)) & _LOW_NIBBLES) | (high & ~_LOW_NIBBLES)).view(np.uint8).reshape(n, -1, 8)
    return torch.from_numpy(out.reshape(n, in_features // 2))


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> None:
    if not t.is_cpu or t.dtype != dtype:
        raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def matmul(x: torch.Tensor, w: NativeWeight) -> torch.Tensor:
    """x float32 [M, K] -> x @ W^T, float32 [M, N], in the weight's arithmetic (see NativeWeight). Called
    ~120 times per decode step, so the checks come first in one cheap test (the whole wrapper costs ~3 us
    over the kernel's call)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.in_features or not x.is_cpu:
        _check("x", x, torch.float32)
        raise ValueError(f"x must be [M, {w.in_features}], got {tuple(x.shape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty(x.shape[0], w.out_features)
    kernels = _module()
    fn = getattr(kernels, _KERNELS[w.kind, w.bf16][0])
    fn(
        x.data_ptr(),
        w.codes.data_ptr(),
        w.scales.data_ptr(),
        _ptr(w.zeros),
        y.data_ptr(),
        x.shape[0],
        w.in_features,
        w.out_features,
        w.group_size,
        torch.get_num_threads(),
        w.param_mode,
    )
    return y


def has_bf16() -> bool:
    """Whether the kernels' bf16 arithmetic (`native_weight(..., bf16=True)`) was built: AVX512_BF16."""
    return available() and _module().has_bf16()


def dequantize(w: NativeWeight) -> torch.Tensor:
    """The dense [N, K] weight: float32, exactly `formats.dequantize(...)` (q * scale, then + zero); for an
    int4 weight in bf16 arithmetic, q * scale + zero in one FMA rounded to bf16, the values the bf16 GEMV
    multiplies, so oneDNN's bf16 GEMM over it computes what `matmul` does. (int5 and int8 in bf16: float32,
    whose GEMM over x rounded to bf16 computes `matmul`'s sums in another order.)"""
    out = torch.empty(w.out_features, w.in_features, dtype=w.dense_dtype)
    kernels = _module()
    fn = getattr(kernels, _KERNELS[w.kind, w.bf16][2])
    fn(
        w.codes.data_ptr(),
        w.scales.data_ptr(),
        _ptr(w.zeros),
        out.data_ptr(),
        w.out_features,
        w.in_features,
        w.group_size,
        torch.get_num_threads(),
        w.param_mode,
    )
    return out


def dequantize_rows(w: NativeWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64 [M]) of the weight, float32 [M, K], each exactly as `dequantize` expands it in float32
    (q * scale, then + zero): an embedding's lookup in one call. An id outside [0, N) raises IndexError."""
    if ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous():
        raise ValueError(f"ids must be a contiguous int64 vector, got {ids.dtype} {tuple(ids.shape)}")
    out = torch.empty(ids.shape[0], w.in_features, dtype=torch.float32)
    _module().dequantize_rows(
        w.codes.data_ptr(),
        w.scales.data_ptr(),
        _ptr(w.zeros),
        out.data_ptr(),
        ids.data_ptr(),
        ids.shape[0],
        w.out_features,
        w.in_features,
        w.group_size,
        w.param_mode,
        _BITS[w.kind],
    )
    return out


def attention_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_decode_attention` takes these: float32 queries and cache, sizes within its buffers."""
    return q.dtype == k_cache.dtype == torch.float32 and attention_shape_fits(
        q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1]
    )


def attention_shape_fits(heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
    """kernels.c's attention buffers: MAX_GROUP_DIM query heads per KV head times head dim, MAX_BLOCK keys."""
    return heads % kv_heads == 0 and heads // kv_heads * head_dim <= _MAX_GROUP_DIM and block_size <= _MAX_BLOCK


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One-token queries q float32 [nd, Hq, D] (rows may be strided, heads contiguous) against float32
    caches [num_blocks, block_size, Hk, D], as `ember.ops.functional.paged_attention` defines it:
    the query of sequence i sits at position seq_lens[i] - 1 and sees keys p - window < j <= p;
    scores are scaled, then soft-capped (cap * tanh(s / cap)); sinks [Hq] join each softmax
    denominator. block_tables int32 [>= nd, W] (rows may be strided), seq_lens int32 [>= nd]."""
    nd, hq, d = q.shape
    _check("q", q, torch.float32)
    _check("k_cache", k_cache, torch.float32)
    _check("v_cache", v_cache, torch.float32, tuple(k_cache.shape))
    _check("block_tables", block_tables, torch.int32)
    _check("seq_lens", seq_lens, torch.int32)
    _, block_size, hk, dk = k_cache.shape
    if dk != d or not attention_fits(q, k_cache):
        raise ValueError(
            f"q {tuple(q.shape)} does not fit k_cache {tuple(k_cache.shape)}: head dims must match, "
            f"heads divide evenly, heads per KV head x head dim <= {_MAX_GROUP_DIM}, block <= {_MAX_BLOCK}"
        )
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if block_tables.dim() != 2 or block_tables.shape[0] < nd or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [>= {nd}, W] with contiguous rows, got {tuple(block_tables.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] < nd or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be a contiguous [>= {nd}] tensor, got {tuple(seq_lens.shape)}")
    if sinks is not None:
        sinks = sinks.float().contiguous()
        _check("sinks", sinks, torch.float32, (hq,))
    out = torch.empty(nd, hq, d)
    _module().paged_decode_attention(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        _ptr(sinks),
        out.data_ptr(),
        nd,
        hq,
        hk,
        d,
        block_size,
        window or 0,
        float(scale),
        float(soft_cap or 0.0),
        torch.get_num_threads(),
    )
    return out


def argmax_fits(x: torch.Tensor) -> bool:
    """Whether `argmax` takes x: CPU float32 [M, N > 0] with contiguous rows."""
    return x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), the same index (the first largest; a NaN's where there is one), for x that
    `argmax_fits`: int64 [M]. torch's took 43 us over the default model's 49152 logits (argmax.c)."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _module().argmax(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.stride(0), torch.get_num_threads())
    return out


def rows_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) through `argmax` where it takes x and the kernels run, else torch's: the same index
    either way. For sampling's 16 random rows of the default model's 49,152 tokens on 2 cores, torch's
    took 0.46 ms and the kernel 0.035 (2026-12-07)."""
    return argmax(x) if argmax_fits(x) and available() else x.argmax(dim=-1)


# ---- fused decode-layer ops (kernels.c's last section): float32, rows contiguous ----


def _rows(name: str, t: torch.Tensor, width: int) -> None:
    if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != width or not t.is_cpu or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous CPU float32 [M, {width}] tensor, got {t.dtype} {tuple(t.shape)} on {t.device}"
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, weight) over the last dim of x float32 [M, N] (weight float32 [N])."""
    _rows("x", x, weight.shape[0])
    _check("weight", weight, torch.float32)
    out = torch.empty_like(x)
    _module().add_rms_norm(
        x.data_ptr(),
        0,
        weight.data_ptr(),
        out.data_ptr(),
        0,
        x.shape[0],
        x.shape[1],
        float(eps),
        torch.get_num_threads(),
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.rms_norm(x + residual, weight), x + residual) for float32 [M, N] x and residual, in one pass."""
    _rows("x", x, weight.shape[0])
    _rows("residual", residual, weight.shape[0])
    _check("weight", weight, torch.float32)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} must match")
    out, total = torch.empty_like(x), torch.empty_like(x)
    _module().add_rms_norm(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        total.data_ptr(),
        x.shape[0],
        x.shape[1],
        float(eps),
        torch.get_num_threads(),
    )
    return out, total


def rotary_store_fits(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """Whether `rotary_store` takes these: float32 [T, width] activations, tables and cache on CPU,
    int64 positions and slots (other cases keep the PyTorch ops; whether the kernels are available is the
    caller's to ask, once)."""
    return (
        qkv.is_cpu
        and qkv.dim() == 2
        and qkv.dtype == cos.dtype == k_cache.dtype == torch.float32
        and positions.dtype == slot_mapping.dtype == torch.int64
    )


def rotary_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
) -> None:
    """The fused QKV output qkv float32 [T, (Hq + 2 Hk) * D] (rows may be strided): its query and key
    heads rotated in place, neox style, with the [max_positions, D] tables' rows at positions (int64 [T];
    sin_signed is sin with its first half negated, as RotaryEmbedding keeps it), bit for bit
    RotaryEmbedding's CPU ops; then keys and values written to the float32 caches [num_blocks,
    block_size, Hk, D] at slot_mapping (int64 [T], -1: skipped), as `store_kv` does."""
    _, _, hk, d = k_cache.shape
    _check("k_cache", k_cache, torch.float32)
    _check("v_cache", v_cache, torch.float32, tuple(k_cache.shape))
    _check("cos", cos, torch.float32)
    _check("sin_signed", sin_signed, torch.float32, tuple(cos.shape))
    _check("positions", positions, torch.int64)
    _check("slot_mapping", slot_mapping, torch.int64)
    t = qkv.shape[0]
    if (
        qkv.dtype != torch.float32
        or qkv.dim() != 2
        or qkv.shape[1] != (num_q_heads + 2 * hk) * d
        or qkv.stride(1) != 1
        or not qkv.is_cpu
    ):
        raise ValueError(
            f"qkv must be a CPU float32 [T, {(num_q_heads + 2 * hk) * d}] tensor with contiguous rows, "
            f"got {qkv.dtype} {tuple(qkv.shape)}"
        )
    if cos.dim() != 2 or cos.shape[1] != d or d % 2 or positions.shape != (t,) or slot_mapping.shape != (t,):
        raise ValueError(
            f"cos/sin_signed must be [P, {d}] (even), positions and slot_mapping [{t}]; got "
            f"{tuple(cos.shape)}, {tuple(positions.shape)}, {tuple(slot_mapping.shape)}"
        )
    if not (
        k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and cos.is_contiguous()
        and sin_signed.is_contiguous()
        and positions.is_contiguous()
        and slot_mapping.is_contiguous()
    ):
        raise ValueError("caches, tables, positions and slot_mapping must be contiguous")
    _module().rotary_store(
        qkv.data_ptr(),
        qkv.stride(0),
        positions.data_ptr(),
        cos.data_ptr(),
        sin_signed.data_ptr(),
        cos.shape[0],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        k_cache.shape[0] * k_cache.shape[1],
        t,
        num_q_heads,
        hk,
        d,
        torch.get_num_threads(),
    )


def matmul_silu(x: torch.Tensor, w: NativeWeight) -> torch.Tensor:
    """silu(gate) * up for a fused gate/up weight (rows [0, I) gate, [I, 2I) up): `matmul` and the
    activation in one call, float32 [M, K] -> [M, I]."""
    if w.out_features % 2:
        raise ValueError(f"a gate/up weight has an even number of rows, got {w.out_features}")
    _rows("x", x, w.in_features)
    size = w.out_features // 2
    out = torch.empty(x.shape[0], size)
    kernels = _module()
    fn = getattr(kernels, _KERNELS[w.kind, w.bf16][1])
    fn(
        x.data_ptr(),
        w.codes.data_ptr(),
        w.scales.data_ptr(),
        _ptr(w.zeros),
        out.data_ptr(),
        x.shape[0],
        w.in_features,
        size,
        w.group_size,
        torch.get_num_threads(),
        w.param_mode,
    )
    return out


def silu_mul(y: torch.Tensor) -> torch.Tensor:
    """silu(y[:, :I]) * y[:, I:] for y float32 [M, 2I] contiguous, as `matmul_silu` applies it to its GEMV's
    output (for a gate/up output changed between the two: a LoRA delta)."""
    if y.dtype != torch.float32 or y.dim() != 2 or y.shape[1] % 2 or not y.is_contiguous() or not y.is_cpu:
        raise ValueError(f"y must be a contiguous CPU float32 [M, 2I] tensor, got {y.dtype} {tuple(y.shape)}")
    size = y.shape[1] // 2
    out = torch.empty(y.shape[0], size)
    _module().silu_mul(y.data_ptr(), out.data_ptr(), y.shape[0], size, torch.get_num_threads())
    return out


# One projection's LoRA slots (ember/ops/lora.py, LoRAWeights): A [loras, slices * rank, K], then B of each
# slice [loras, rank, n_i], the scale folded in; float32 or bfloat16 (`--lora-dtype`), summed in float32.
LoRASlots = tuple[torch.Tensor, list[torch.Tensor]]
LORA_DTYPES = (torch.float32, torch.bfloat16)


def lora_fits(a: torch.Tensor, b: list[torch.Tensor]) -> bool:
    """Whether `lora_delta` (and `layer_record`) take these slots: contiguous CPU float32 or bfloat16, all
    of one dtype, 1 to 3 slices."""
    return (
        1 <= len(b) <= 3
        and a.dtype in LORA_DTYPES
        and all(t.is_cpu and t.dtype == a.dtype and t.is_contiguous() and t.shape[0] == a.shape[0] for t in (a, *b))
    )


def _lora_bf16(a: torch.Tensor) -> int:
    """The kernels' flag for the slots' dtype (lora.c, lora_ref.bf16)."""
    return int(a.dtype == torch.bfloat16)


def lora_delta(x: torch.Tensor, y: torch.Tensor, lora: LoRASlots, slots: torch.Tensor) -> None:
    """y[t, off_i : off_i + n_i] += (A[s] @ x[t])[i R : (i + 1) R] @ B_i[s] for each row t whose slot s =
    slots[t] is not -1, slice i's columns after the slices before it (lora.c): x float32 [M, K], y float32
    [M, sum n_i] (rows may be strided, columns contiguous), slots int32 [M]. Rows of one slot share its
    weights; no slot no row uses is read."""
    a, b = lora
    m, k = x.shape
    widths = [t.shape[2] for t in b]
    if not lora_fits(a, b) or a.shape[1] != len(b) * b[0].shape[1] or a.shape[2] != k:
        raise ValueError(f"LoRA slots A {tuple(a.shape)}, B {[tuple(t.shape) for t in b]} do not fit x [M, {k}]")
    if x.dtype != torch.float32 or x.stride(1) != 1 or y.dtype != torch.float32 or y.stride(1) != 1:
        raise ValueError("x and y must be float32 with contiguous rows")
    if y.shape != (m, sum(widths)) or slots.dtype != torch.int32 or slots.shape != (m,) or not slots.is_contiguous():
        raise ValueError(f"y must be [{m}, {sum(widths)}] and slots int32 [{m}]")
    pad = [0] * (3 - len(b))
    _module().lora_delta(
        x.data_ptr(),
        x.stride(0),
        y.data_ptr(),
        y.stride(0),
        slots.data_ptr(),
        m,
        a.data_ptr(),
        *[t.data_ptr() for t in b],
        *pad,
        *widths,
        *pad,
        *[sum(widths[:i]) for i in range(len(b))],
        *pad,
        len(b),
        b[0].shape[1],
        k,
        a.shape[0],
        _lora_bf16(a),
        torch.get_num_threads(),
    )


def matmul_lora(
    x: torch.Tensor, w: NativeWeight, bias: torch.Tensor | None, lora: LoRASlots, slots: torch.Tensor
) -> torch.Tensor:
    """`matmul(x, w)` (+ bias), then `lora_delta` of its rows, the same numbers in one native call whose
    GEMV's parallel region also runs the delta (gemv_lora, as decode_layers adds it): x float32 [M, K]
    contiguous, bias float32 [N] or None, the slices' widths summing to N, slots int32 [M]."""
    a, b = lora
    m, k = x.shape
    widths = [t.shape[2] for t in b]
    if x.dtype != torch.float32 or not x.is_contiguous() or k != w.in_features:
        raise ValueError(f"x must be contiguous float32 [M, {w.in_features}], got {tuple(x.shape)}")
    if not lora_fits(a, b) or a.shape[1] != len(b) * b[0].shape[1] or a.shape[2] != k or sum(widths) != w.out_features:
        raise ValueError(
            f"LoRA slots A {tuple(a.shape)}, B {[tuple(t.shape) for t in b]} do not fit W {w.out_features}x{k}"
        )
    if slots.dtype != torch.int32 or slots.shape != (m,) or not slots.is_contiguous():
        raise ValueError(f"slots must be int32 [{m}]")
    if bias is not None:
        _check("bias", bias, torch.float32, (w.out_features,))
        bias = bias.contiguous()
    y = torch.empty(m, w.out_features)
    pad = [0] * (3 - len(b))
    _module().gemv_lora(
        x.data_ptr(),
        w.codes.data_ptr(),
        w.scales.data_ptr(),
        _ptr(w.zeros),
        y.data_ptr(),
        m,
        k,
        w.out_features,
        w.group_size,
        torch.get_num_threads(),
        w.param_mode,
        _arithmetic_bits(w),
        _ptr(bias),
        slots.data_ptr(),
        a.data_ptr(),
        *[t.data_ptr() for t in b],
        *pad,
        *widths,
        *pad,
        len(b),
        b[0].shape[1],
        a.shape[0],
        _lora_bf16(a),
    )
    return y


def _arithmetic_bits(w: NativeWeight) -> int:
    """The kernels' name for the weight's layout and arithmetic: 4, 5 or 8, | 16 in bf16 (gemv.c, BF16)."""
    return _BITS[w.kind] | (_BF16 if w.bf16 else 0)


def _weight_args(w: NativeWeight) -> tuple[int, ...]:
    """A weight as a layer record holds it: codes, scales, zeros, group, half, bits (`_arithmetic_bits`)."""
    bits = _arithmetic_bits(w)
    return (
        w.codes.data_ptr(),
        w.scales.data_ptr(),
        _ptr(w.zeros),
        w.group_size,
        w.param_mode,
        bits,
    )


@dataclass(frozen=True)
class DecodeLayerWeights:
    """What `decode_layers` needs of a Llama decoder layer, gathered once when the layer chooses its kernels:
    the norms' float32 weights, the four projections as native weights, the attention's shape and masking."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: NativeWeight
    o: NativeWeight
    gate_up: NativeWeight
    down: NativeWeight
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int
    soft_cap: float
    q_norm: torch.Tensor | None = None  # Qwen3's per-head RMSNorm weights, float32 [D]
    k_norm: torch.Tensor | None = None
    qk_norm_eps: float = 0.0
    qkv_bias: torch.Tensor | None = None  # Qwen2's, float32 [(Hq + 2 Hk) D]
    lora: tuple[LoRASlots, LoRASlots, LoRASlots, LoRASlots] | None = None  # qkv, o, gate/up, down (lora_fits)


def layer_caches_fit(w: DecodeLayerWeights, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `layer_record` takes this layer's KV cache: float32, contiguous, blocks and head groups
    within the attention kernel's buffers."""
    return (
        k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.is_cpu
        and k_cache.shape == v_cache.shape
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and attention_shape_fits(w.num_q_heads, w.num_kv_heads, w.head_dim, k_cache.shape[1])
    )


def layer_record(
    w: DecodeLayerWeights, cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> list[int]:
    """A layer's fixed arguments in the order of kernels' records (fused.c, R_*): pointers to its weights,
    rotary tables (float32 [P, D], contiguous) and caches (which must fit: `layer_caches_fit`), its sizes,
    and its float arguments as float64 bits. The tensors must outlive every `decode_layers` call on it."""
    if not layer_caches_fit(w, k_cache, v_cache) or not (cos.is_contiguous() and sin_signed.is_contiguous()):
        raise ValueError("decode_layers takes float32 contiguous caches and tables within its attention buffers")
    _check("cos", cos, torch.float32)
    _check("sin_signed", sin_signed, torch.float32, tuple(cos.shape))
    blocks, block_size = k_cache.shape[:2]
    floats = torch.tensor([w.eps, w.scale, w.soft_cap, w.qk_norm_eps], dtype=torch.float64).view(torch.int64)
    record = [
        w.in_norm.data_ptr(),
        w.post_norm.data_ptr(),
        *(arg for nat in (w.qkv, w.o, w.gate_up, w.down) for arg in _weight_args(nat)),
        cos.data_ptr(),
        sin_signed.data_ptr(),
        cos.shape[0],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        blocks * block_size,
        block_size,
        w.window,
        w.in_norm.shape[0],
        w.num_q_heads,
        w.num_kv_heads,
        w.head_dim,
        w.gate_up.out_features // 2,
        _ptr(w.q_norm),
        _ptr(w.k_norm),
        _ptr(w.qkv_bias),
        *_lora_args(w.lora),
        *floats.tolist(),
    ]
    if len(record) != _module().layer_fields():
        raise RuntimeError(f"a layer record of {len(record)} fields; the kernels take {_module().layer_fields()}")
    return record


def _lora_args(lora: tuple[LoRASlots, ...] | None) -> list[int]:
    """A layer's LoRA fields (fused.c, R_LORAS..): slots, rank, bf16, then per projection A and each slice's
    B."""
    if lora is None:
        return [0] * 19
    out = [lora[0][0].shape[0], lora[0][1][0].shape[1], _lora_bf16(lora[0][0])]
    for a, b in lora:
        out += [a.data_ptr(), *(t.data_ptr() for t in b), *[0] * (3 - len(b))]
    return out


def decode_layers_fit(
    x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """Whether `decode_layers` takes this step's tensors: float32 contiguous [M, H] rows and residual on
    CPU, int64 positions and slots. (The caches were checked with the records; rows past the weights' GEMV
    crossover are the caller's to exclude.)"""
    return (
        x.dtype == torch.float32
        and x.is_cpu
        and x.dim() == 2
        and x.is_contiguous()
        and (residual is None or (residual.dtype == torch.float32 and residual.is_contiguous()))
        and positions.dtype == slot_mapping.dtype == torch.int64
    )


def decode_layers(
    records: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    lora_slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive Llama decoder layers (two RMSNorms, fused QKV with full neox rotary and Qwen2's bias if
    any, SiLU gated MLP), records int64 [L, fields] of `layer_record`s, over x float32 [M, H], M one-token
    sequences, in one native call: the same kernels the layers' modules call one by one (rms_norm/
    add_rms_norm, matmul, rotary_store, paged_decode_attention, matmul_silu), so bit for bit their result,
    without ~8 Python wrappers and module calls a layer, nor a Python call between layers (the default
    model's 30 cost ~1 ms a step, 2026-12-05). With Qwen3's QK norm the heads are normalised by the
    kernels' RMSNorm where the modules use PyTorch's (the same formula, float32 summation order apart).
    residual None: the first layer of the model. Returns (MLP output, residual stream) of the last layer
    as DecoderLayer.forward does. lora_slots: each row's adapter slot (int32 [M], -1: none) in the layers'
    LoRA weights (DecodeLayerWeights.lora), whose deltas are added to the projections' outputs as
    `lora_delta` adds them; None: no row has an adapter."""
    m, h = x.shape
    out, residual_out = torch.empty(m, h), torch.empty(m, h)
    _module().decode_layers(
        records.data_ptr(),
        records.shape[0],
        x.data_ptr(),
        _ptr(residual),
        positions.data_ptr(),
        slot_mapping.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        m,
        torch.get_num_threads(),
        out.data_ptr(),
        residual_out.data_ptr(),
        _ptr(lora_slots),
    )
    return out, residual_out
