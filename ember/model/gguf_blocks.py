"""GGUF tensors decoded with numpy: to float32, or exactly into Ember's QuantizedWeight.

Which form each type takes:
- F32, F16, BF16: float.
- Every quantized type (gguf_codes: legacy, K, IQ4, ternary and MXFP4 quants; gguf_grids: the
  lattice IQ1/IQ2/IQ3 types): integer codes times per-group scales plus zero terms, kept as a
  QuantizedWeight of the same values, or evaluated to float32 from the same decoding, so the two
  forms cannot disagree.

Decoding runs over bounded chunks of blocks written into preallocated outputs, so peak memory
stays near one tensor and every step is a numpy op over thousands of blocks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from ember.model.gguf_codes import BLOCK_CODES, BlockCodes
from ember.model.gguf_grids import GRID_CODES
from ember.quant.formats import QuantizedWeight, ScaleFactors, code_bytes

# Elements decoded at once: chunks of a few thousand 256-element blocks keep the intermediates in cache
# (65536-block chunks took 2.4x the CPU time of 4096 for Q4_K and 2.1x for Q6_K on a 4096x4096 tensor,
# 1024-block chunks 1.1x). 2048 rather than 4096 keeps each temporary (Q6_K's codes: 512 KB) below the
# sizes glibc keeps mapping and unmapping afresh: a first decode of the 1.5B-parameter Q4_K_M file then
# faulted in 344k pages in every run (the outputs) against 506-834k, 0.57-0.67 s of system time against
# 0.76-1.33. Counted in elements, so 32-element blocks come 16384 at a time with temporaries of the same
# size: at 2048 a Qwen2-0.5B Q4_K_M file's Q5_0 (7.9M blocks, now one copy each) took 0.20-0.27 s in
# 3.9k chunks' overhead against 0.08-0.11 s (2-core EPYC, 2026-12-07).
_ELEMENTS_PER_CHUNK = 1 << 19
_pools: dict[int, ThreadPoolExecutor] = {}

_TORCH_DTYPES: dict[type, torch.dtype] = {
    np.uint8: torch.uint8,
    np.int8: torch.int8,
    np.float16: torch.float16,
    np.float32: torch.float32,
}
# Q4_1's blocks ([d: fp16][m: fp16][16 bytes: input j low, j + 16 high nibble]) are codes, scales and zeros as
# the native CPU kernels read them, so they are kept as stored (`runs` weights; other consumers repack them,
# formats.packed): the default model's 210 matrices in 0.05 s of CPU against 0.33 s decoding them to Ember's
# packing with float32 scales and re-laying that out (2-core EPYC, 2026-12-07). Q4_0's zero term -8d is no
# stored field (its float16 form may overflow), so Q4_0 takes the decoding path.
_RUNS_TYPES = frozenset({QType.Q4_1})
_CODES: dict[QType, BlockCodes] = BLOCK_CODES | GRID_CODES
FLOAT_TYPES = frozenset({QType.F32, QType.F16, QType.BF16})
QUANTIZED_TYPES = frozenset(_CODES)  # types that can stay quantized
SUPPORTED_TYPES = FLOAT_TYPES | QUANTIZED_TYPES


def supported_names() -> str:
    return ", ".join(t.name for t in sorted(SUPPORTED_TYPES))


def quantized_form(qtype: QType) -> str:
    """The QuantizedWeight a type's matrices are kept as, e.g. "int4 g32", for the load log."""
    fmt = _CODES[qtype]
    return f"{fmt.kind} g{fmt.group_size}"


def _stored_blocks(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's bytes as uint8 [blocks, block bytes], checked to hold a tensor of `shape`.

    `raw` is GGUFTensor.data or any other array holding the same bytes (gguf.quants output, say);
    only its bytes matter, so any view of the same memory works.
    """
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported tensor type {qtype.name} (supported: {supported_names()})")
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size or data.size != math.prod(shape) // block_size * block_bytes:
        raise ValueError(f"{data.size} bytes of {qtype.name} do not hold a tensor of shape {shape}")
    return data.reshape(-1, block_bytes)


def _empty(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """An output array in memory from torch's allocator. numpy asks the kernel for transparent huge
    pages on arrays of 4 MB and more, and on this project's VM the compaction that forces took the
    1.5B-parameter Q4_K_M file's first decode from 0.9-1.1 to 2.8 s of system time (user time 1.4 s)."""
    return torch.empty(shape, dtype=_TORCH_DTYPES[dtype]).numpy()


def _pool() -> ThreadPoolExecutor:
    """numpy releases the GIL inside its array ops, so chunks decode in parallel on every core. One
    pool per process: a forked child must not inherit the parent's pool, whose threads it lacks."""
    pid = os.getpid()
    if pid not in _pools:
        _pools[pid] = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="gguf-decode")
    return _pools[pid]


def _each_chunk(n: int, block_size: int, decode: Callable[[slice], None]) -> None:
    """Run `decode` on every chunk of n blocks across the pool; chunks write disjoint rows."""
    step = max(1, _ELEMENTS_PER_CHUNK // block_size)
    chunks = [slice(start, start + step) for start in range(0, n, step)]
    if len(chunks) == 1:
        decode(chunks[0])
    else:
        for _ in _pool().map(decode, chunks):  # re-raises a chunk's exception
            pass


def _dense(blocks: np.ndarray, fmt: BlockCodes, out: np.ndarray) -> None:
    """Evaluate the affine form in float32 as a rounded product, then a rounded sum (never a fused
    multiply-add), the steps llama.cpp's reference takes."""
    n = len(blocks)
    scales, zeros = fmt.affine(blocks)
    w = out.reshape(n, -1, fmt.group_size)
    np.multiply(fmt.codes(blocks).reshape(w.shape), scales[:, :, None], out=w, dtype=np.float32)
    if zeros is not None:
        w += zeros[:, :, None]


def dequantize(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a tensor's stored bytes (see _stored_blocks) into a float32 array of the given numpy shape."""
    blocks = _stored_blocks(raw, qtype, shape)
    if qtype in FLOAT_TYPES:
        out = _empty(shape, np.float32)
        if qtype == QType.BF16:  # the top half of a float32
            np.left_shift(blocks.view(np.uint16).reshape(shape), 16, out=out.view(np.uint32), dtype=np.uint32)
        else:
            np.copyto(out, blocks.view(np.float32 if qtype == QType.F32 else np.float16).reshape(shape))
        return out
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    out = _empty((len(blocks), block_size), np.float32)

    def decode(rows: slice) -> None:
        _dense(blocks[rows], _CODES[qtype], out[rows])

    _each_chunk(len(blocks), block_size, decode)
    return out.reshape(shape)


def quantized(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> QuantizedWeight:
    """Re-lay a 2-D block-quantized tensor out as a QuantizedWeight, without rounding anything.

    Every mapped GGUF type is already codes times a per-group scale plus a zero term, so the
    result dequantizes to exactly what dequantize() returns while keeping the codes (plus float32
    scales) instead of a float copy.
    """
    if qtype not in QUANTIZED_TYPES or len(shape) != 2:
        raise ValueError(
            f"a {qtype.name} tensor of shape {shape} has no quantized form "
            f"(2-D tensors of {', '.join(t.name for t in QUANTIZED_TYPES)} only)"
        )
    fmt = _CODES[qtype]
    blocks = _stored_blocks(raw, qtype, shape)
    if qtype in _RUNS_TYPES:
        return _runs(blocks, fmt, shape)
    n, block_size = len(blocks), gguf.GGML_QUANT_SIZES[qtype][0]
    int4 = fmt.kind == "int4"
    qweight = _empty((n, code_bytes(fmt.kind, block_size)), np.int8 if fmt.kind == "int8" else np.uint8)
    scales = _empty((n, block_size // fmt.group_size), np.float32)
    zeros = _empty(scales.shape, np.float32) if fmt.has_zeros else None
    factors = _factor_arrays(n, scales.shape[1], fmt.has_zeros) if fmt.factors is not None else None

    def decode(rows: slice) -> None:
        chunk = blocks[rows]
        # Blocks hold an even number of elements, so packing block by block packs the row.
        if fmt.write is not None:
            fmt.write(chunk, qweight[rows])
        elif int4:
            codes = fmt.codes(chunk)
            np.bitwise_or(codes[:, 0::2], codes[:, 1::2] << 4, out=qweight[rows])
        else:
            qweight[rows] = fmt.codes(chunk)
        scales[rows], chunk_zeros = fmt.affine(chunk)
        if zeros is not None:
            zeros[rows] = chunk_zeros
        if factors is not None and fmt.factors is not None:
            for array, part in zip(factors, fmt.factors(chunk)):
                if array is not None and part is not None:
                    array[rows] = part

    _each_chunk(n, block_size, decode)
    out_features, in_features = shape

    def rows(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.reshape(out_features, -1))

    def optional_rows(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else rows(a)

    return QuantizedWeight(
        kind=fmt.kind,
        qweight=rows(qweight),
        scales=rows(scales),
        zeros=optional_rows(zeros),
        group_size=fmt.group_size,
        in_features=in_features,
        factors=None
        if factors is None
        else ScaleFactors(
            scales.shape[1],
            rows(factors[0]),
            rows(factors[1]),
            optional_rows(factors[2]),
            optional_rows(factors[3]),
        ),
    )


def _runs(blocks: np.ndarray, fmt: BlockCodes, shape: tuple[int, ...]) -> QuantizedWeight:
    """Q4_1 blocks as a `runs` QuantizedWeight: each block's codes, d and m copied out as they are."""
    n, (out_features, in_features) = len(blocks), shape
    codes = _empty((n, 16), np.uint8)
    scales, zeros = _empty((n, 1), np.float16), _empty((n, 1), np.float16)

    def copy(rows: slice) -> None:
        chunk = blocks[rows]
        np.copyto(codes[rows], chunk[:, 4:])
        np.copyto(scales[rows], chunk[:, 0:2].view(np.float16))
        np.copyto(zeros[rows], chunk[:, 2:4].view(np.float16))

    _each_chunk(n, fmt.group_size, copy)
    return QuantizedWeight(
        kind=fmt.kind,
        qweight=torch.from_numpy(codes.reshape(out_features, -1)),
        scales=torch.from_numpy(scales.reshape(out_features, -1)),
        zeros=torch.from_numpy(zeros.reshape(out_features, -1)),
        group_size=fmt.group_size,
        in_features=in_features,
        runs=True,
    )


def _factor_arrays(
    blocks: int, groups: int, zeros: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Outputs for a K-quant's ScaleFactors: a base per block and a code per group, for scales and zeros."""

    def pair() -> tuple[np.ndarray, np.ndarray]:
        return _empty((blocks, 1), np.float32), _empty((blocks, groups), np.int8)

    return (*pair(), *(pair() if zeros else (None, None)))
