"""GGUF block-quantized tensors decoded with numpy: to float32, or exactly into Ember's QuantizedWeight.

Both come from one decoding per block type (codes, per-group scales and zero terms), so the two
forms cannot disagree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from ember.quant.formats import QuantizedWeight, pack_int4

# Bound on blocks dequantized at once, so a large embedding does not need several
# float32 copies of itself in intermediate arrays.
_BLOCKS_PER_CHUNK = 1 << 16


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """An fp16 field at byte `start` of every block, as a float32 column for broadcasting."""
    return blocks[:, start:start + 2].view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Split bytes [..., n] into [..., 2, n]: low nibbles first, then high nibbles."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-2)


class _Codes(NamedTuple):
    """Decoded blocks in the affine form shared by every type: element i of block b is
    `q[b, i] * scales[b, i // g] + zeros[b, i // g]` (no zeros: symmetric).

    This is already Ember's QuantizedWeight form, so quantized() only re-lays it out, and
    evaluating it in float32 reproduces llama.cpp's own decoding bit for bit (Q4_0 aside, whose
    zero term turns some of llama.cpp's -0.0 into +0.0).
    """

    q: np.ndarray             # [blocks, block size]: int8 codes, or uint8 nibbles for int4 types
    scales: np.ndarray        # float32 [blocks, block size // g]
    zeros: np.ndarray | None  # float32, shape of scales


def _q8_0(blocks: np.ndarray) -> _Codes:
    # [d: fp16][32 x int8]
    return _Codes(blocks[:, 2:].view(np.int8), _fp16(blocks, 0), None)


def _q4_0(blocks: np.ndarray) -> _Codes:
    # [d: fp16][16 bytes: element i in the low nibble of byte i, element i+16 in its high nibble];
    # the value is d * (nibble - 8), i.e. an unsigned nibble with zero term -8d.
    d = _fp16(blocks, 0)
    return _Codes(_nibbles(blocks[:, 2:]).reshape(len(blocks), 32), d, d * np.float32(-8))


def _q4_1(blocks: np.ndarray) -> _Codes:
    # [d: fp16][m: fp16][16 bytes of nibbles as in Q4_0, unsigned]
    return _Codes(_nibbles(blocks[:, 4:]).reshape(len(blocks), 32), _fp16(blocks, 0), _fp16(blocks, 2))


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte field of 8 six-bit scales and 8 six-bit mins used by Q4_K and Q5_K.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; for sub-blocks 4-7 the
    low 4 bits sit in bytes 8-11 (scale low nibble, min high nibble) and the top 2 bits are the
    spare high bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    lo_sc, lo_min, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([lo_sc & 0x3F, (extra & 0x0F) | ((lo_sc >> 6) << 4)], axis=1)
    mins = np.concatenate([lo_min & 0x3F, (extra >> 4) | ((lo_min >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_affine(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K sub-block scales d*sc and zero terms -(dmin*m).

    llama.cpp computes `d*sc * q - dmin*m`; IEEE defines a - b as a + (-b), so adding the negated
    min gives the same bits.
    """
    scales, mins = _k_scales(blocks[:, 4:16])
    return _fp16(blocks, 0) * scales, -(_fp16(blocks, 2) * mins)


def _q4_k(blocks: np.ndarray) -> _Codes:
    # [d: fp16][dmin: fp16][12 bytes scales/mins][128 bytes: 4 groups of 32 bytes, each holding
    # sub-block 2j in the low nibbles and sub-block 2j+1 in the high nibbles]
    n = len(blocks)
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 256)
    return _Codes(q, *_k_affine(blocks))


def _q5_k(blocks: np.ndarray) -> _Codes:
    # Q4_K's layout with 32 extra bytes (after the scales) whose bit k of byte l is the fifth
    # bit of element l of sub-block k. Codes 0..31 fit int8 as they are.
    n = len(blocks)
    high = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    low = _nibbles(blocks[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    return _Codes((low | (high << 4)).reshape(n, 256).view(np.int8), *_k_affine(blocks))


def _q6_k(blocks: np.ndarray) -> _Codes:
    # [128 bytes low nibbles][64 bytes high 2-bit pairs][16 x int8 scales][d: fp16]. Each half
    # of 128 elements uses 64 low bytes (elements 0-63 low nibbles, 64-127 high nibbles) and
    # 32 high bytes (bit pair k of byte l belongs to element 32k + l); one scale per 16 elements.
    n = len(blocks)
    low = _nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 2, 128)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 2, 128)
    q = (low | (high << 4)).reshape(n, 256).view(np.int8) - np.int8(32)
    scales = _fp16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return _Codes(q, scales, None)


class _BlockFormat(NamedTuple):
    """How a GGUF block type maps onto a QuantizedWeight."""

    kind: str          # QuantizedWeight kind that holds the codes
    group_size: int    # elements sharing one scale (and zero)
    has_zeros: bool
    decode: Callable[[np.ndarray], _Codes]


_BLOCK_FORMATS: dict[QType, _BlockFormat] = {
    QType.Q8_0: _BlockFormat("int8", 32, False, _q8_0),
    QType.Q4_0: _BlockFormat("int4", 32, True, _q4_0),
    QType.Q4_1: _BlockFormat("int4", 32, True, _q4_1),
    QType.Q4_K: _BlockFormat("int4", 32, True, _q4_k),
    QType.Q5_K: _BlockFormat("int8", 32, True, _q5_k),
    QType.Q6_K: _BlockFormat("int8", 16, False, _q6_k),
}
QUANTIZED_TYPES = frozenset(_BLOCK_FORMATS)  # types that can stay quantized
SUPPORTED_TYPES = frozenset({QType.F32, QType.F16, QType.BF16, *_BLOCK_FORMATS})


def _stored_blocks(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's bytes as uint8 [blocks, block bytes], checked to hold a tensor of `shape`.

    `raw` is GGUFTensor.data or any other array holding the same bytes (gguf.quants output, say);
    only its bytes matter, so any view of the same memory works.
    """
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported tensor type {qtype.name}")
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size or data.size != math.prod(shape) // block_size * block_bytes:
        raise ValueError(f"{data.size} bytes of {qtype.name} do not hold a tensor of shape {shape}")
    return data.reshape(-1, block_bytes)


def _decoded_chunks(
    blocks: np.ndarray, decode: Callable[[np.ndarray], _Codes]
) -> Iterator[tuple[slice, _Codes]]:
    """Decode a bounded number of blocks at a time, so a large embedding never needs several
    whole-tensor intermediate arrays."""
    for start in range(0, len(blocks), _BLOCKS_PER_CHUNK):
        rows = slice(start, start + _BLOCKS_PER_CHUNK)
        yield rows, decode(blocks[rows])


def _dense(codes: _Codes, group_size: int) -> np.ndarray:
    """Evaluate the affine form in float32 as a rounded product, then a rounded sum (never a fused
    multiply-add), the steps llama.cpp's reference takes."""
    n = len(codes.q)
    w = codes.q.reshape(n, -1, group_size).astype(np.float32) * codes.scales[:, :, None]
    if codes.zeros is not None:
        w += codes.zeros[:, :, None]
    return w.reshape(n, -1)


def dequantize(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a tensor's stored bytes (see _stored_blocks) into a float32 array of the given numpy shape."""
    blocks = _stored_blocks(raw, qtype, shape)
    if qtype == QType.F32:
        return blocks.view(np.float32).reshape(shape).copy()
    if qtype == QType.F16:
        return blocks.view(np.float16).astype(np.float32).reshape(shape)
    if qtype == QType.BF16:
        return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    fmt = _BLOCK_FORMATS[qtype]
    out = np.empty((len(blocks), gguf.GGML_QUANT_SIZES[qtype][0]), dtype=np.float32)
    for rows, codes in _decoded_chunks(blocks, fmt.decode):
        out[rows] = _dense(codes, fmt.group_size)
    return out.reshape(shape)


def quantized(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> QuantizedWeight:
    """Re-lay a 2-D block-quantized tensor out as a QuantizedWeight, without rounding anything.

    Every mapped GGUF type is already codes times a per-group scale plus a zero term, so the
    result dequantizes to exactly what dequantize() returns while keeping the file's memory
    footprint (plus float32 scales).
    """
    if qtype not in _BLOCK_FORMATS or len(shape) != 2:
        raise ValueError(f"a {qtype.name} tensor of shape {shape} has no quantized form "
                         f"(2-D tensors of {', '.join(t.name for t in _BLOCK_FORMATS)} only)")
    fmt = _BLOCK_FORMATS[qtype]
    blocks = _stored_blocks(raw, qtype, shape)
    n, block_size = len(blocks), gguf.GGML_QUANT_SIZES[qtype][0]
    if fmt.kind == "int4":
        qweight = torch.empty((n, block_size // 2), dtype=torch.uint8)
    else:
        qweight = torch.empty((n, block_size), dtype=torch.int8)
    scales = np.empty((n, block_size // fmt.group_size), dtype=np.float32)
    zeros = np.empty_like(scales) if fmt.has_zeros else None
    for rows, codes in _decoded_chunks(blocks, fmt.decode):
        # Blocks hold an even number of elements, so packing block by block packs the row.
        if fmt.kind == "int4":
            qweight[rows] = pack_int4(torch.from_numpy(codes.q))
        else:
            qweight.numpy()[rows] = codes.q
        scales[rows] = codes.scales
        if zeros is not None:
            zeros[rows] = codes.zeros
    out_features, in_features = shape
    return QuantizedWeight(
        kind=fmt.kind,
        qweight=qweight.reshape(out_features, -1),
        scales=torch.from_numpy(scales.reshape(out_features, -1)),
        zeros=None if zeros is None else torch.from_numpy(zeros.reshape(out_features, -1)),
        group_size=fmt.group_size,
        in_features=in_features,
    )
