"""The grid-based IQ types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) as integer codes.

Each stores, per group of 8 (or 4) weights, an index into a lattice of small integer points plus
sign bits (or, for IQ1, a +-1/8 shift), and a scale per 16 or 32 weights. A signed lattice point is
an integer vector, so `code = +-grid[index]` (IQ1: `8 * grid + +-1` with scale/8) with the block's
scale is the same value as the reference's `scale * grid * sign`, bit for bit: IEEE products are
sign-symmetric and multiplying by 1/8 is exact. That turns a 11-35 MB/s decode by
`gguf.quants` into table look-ups at hundreds of MB/s and keeps the weights at 8 bits instead of
the model dtype's 16. The lattices and sign tables are the reference's own (gguf.quants).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.quants import IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS

from ember.model.gguf_codes import Affine, BlockCodes, fp16_field, nibble_pairs


def _table(cls: type[IQ1_S | IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S]) -> np.ndarray:
    """A reference class's lattice as int8 [points, dims]."""
    cls.init_grid()
    assert cls.grid is not None  # init_grid sets it
    return cls.grid.reshape(cls.grid_shape).astype(np.int8)


_GRID = {cls: _table(cls) for cls in (IQ1_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S)}
_KSIGNS = np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8)  # 7-bit index -> 8 sign bits (even parity)
_SIGN_SHIFTS = np.array([0, 7, 14, 21], dtype=np.uint32)


def _signs(bits: np.ndarray) -> np.ndarray:
    """Bytes [...] -> int8 [..., 8]: -1 where bit k is set, else 1."""
    return 1 - 2 * np.unpackbits(bits[..., None], axis=-1, bitorder="little").view(np.int8)


def _u32(b: np.ndarray, start: int, count: int) -> np.ndarray:
    return np.ascontiguousarray(b[:, start : start + 4 * count]).view(np.uint32)


# IQ2_XXS [d][8 x (4 lattice indices, u32: 4 x 7-bit sign indices, 4-bit scale)]: groups of 32.
def _iq2_xxs_codes(b: np.ndarray) -> np.ndarray:
    n = len(b)
    aux = _u32(b, 2, 16).reshape(n, 8, 2)[..., 1]
    signs = _signs(_KSIGNS[(aux[..., None] >> _SIGN_SHIFTS) & 0x7F])
    return (_GRID[IQ2_XXS][b[:, 2:].reshape(n, 8, 8)[..., :4]] * signs).reshape(n, 256)


def _iq2_xxs_affine(b: np.ndarray) -> Affine:
    aux = _u32(b, 2, 16).reshape(len(b), 8, 2)[..., 1]
    return fp16_field(b, 0) * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.25), None


# IQ2_XS [d][32 x u16: 9-bit index, 7-bit sign index][8 bytes: 4-bit scales]: groups of 16.
def _iq2_xs_codes(b: np.ndarray) -> np.ndarray:
    q = np.ascontiguousarray(b[:, 2:66]).view(np.uint16)
    return (_GRID[IQ2_XS][q & 511] * _signs(_KSIGNS[q >> 9])).reshape(len(b), 256)


def _iq2_scales(b: np.ndarray, start: int) -> Affine:
    """8 bytes of 4-bit scales s, one per 16 weights: d * (1/2 + s) / 4."""
    return fp16_field(b, 0) * (np.float32(0.5) + nibble_pairs(b[:, start : start + 8])) * np.float32(0.25), None


# IQ2_S [d][32 index low bytes][32 sign bytes][8 bytes: 2-bit index highs][8 bytes: 4-bit scales].
def _iq2_s_codes(b: np.ndarray) -> np.ndarray:
    n = len(b)
    high = ((b[:, 66:74, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).reshape(n, 32)
    index = b[:, 2:34].astype(np.uint16) | (high.astype(np.uint16) << 8)
    return (_GRID[IQ2_S][index] * _signs(b[:, 34:66])).reshape(n, 256)


# IQ3_XXS [d][64 lattice indices (4-dim)][8 x u32: 4 x 7-bit sign indices, 4-bit scale]: groups of 32.
def _iq3_xxs_codes(b: np.ndarray) -> np.ndarray:
    n = len(b)
    signs = _signs(_KSIGNS[(_u32(b, 66, 8)[..., None] >> _SIGN_SHIFTS) & 0x7F]).reshape(n, 8, 32)
    return (_GRID[IQ3_XXS][b[:, 2:66]].reshape(n, 8, 32) * signs).reshape(n, 256)


def _iq3_xxs_affine(b: np.ndarray) -> Affine:
    aux = _u32(b, 66, 8)
    return fp16_field(b, 0) * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.5), None


# IQ3_S [d][64 index low bytes][8 bytes: index high bits][32 sign bytes][4 bytes: 4-bit scales].
def _iq3_s_codes(b: np.ndarray) -> np.ndarray:
    n = len(b)
    high = np.unpackbits(b[:, 66:74], axis=-1, bitorder="little").astype(np.uint16)
    index = b[:, 2:66].astype(np.uint16) | (high << 8)
    return (_GRID[IQ3_S][index].reshape(n, 32, 8) * _signs(b[:, 74:106])).reshape(n, 256)


def _iq3_s_affine(b: np.ndarray) -> Affine:
    return fp16_field(b, 0) * (1 + 2 * nibble_pairs(b[:, 106:110])), None


def _iq1_codes(grid_index: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """8 * (lattice point + shift): the shift is +1/8, or -1/8 where `negative` (one per point)."""
    shift = np.where(negative, np.int8(-1), np.int8(1))[..., None]
    return (_GRID[IQ1_S][grid_index] * np.int8(8) + shift).reshape(len(grid_index), 256)


# IQ1_S [d][32 index low bytes][8 x u16: 4 x 3-bit index highs, 3-bit scale, shift sign]: groups of 32.
def _iq1_s_codes(b: np.ndarray) -> np.ndarray:
    n = len(b)
    qh = np.ascontiguousarray(b[:, 34:50]).view(np.uint16)
    high = ((qh[..., None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7).reshape(n, 32)
    negative = np.repeat((qh & 0x8000) != 0, 4, axis=1)
    return _iq1_codes(b[:, 2:34].astype(np.uint16) | (high << 8), negative)


def _iq1_s_affine(b: np.ndarray) -> Affine:
    qh = np.ascontiguousarray(b[:, 34:50]).view(np.uint16)
    return fp16_field(b, 0) * (2 * ((qh >> 12) & 7) + 1) * np.float32(0.125), None


# IQ1_M [32 index low bytes][16 bytes: per point a nibble of 3 index high bits and the shift sign]
# [4 x u16: 3-bit scales per 16 weights, the fp16 block scale in the four top nibbles].
def _iq1_m_codes(b: np.ndarray) -> np.ndarray:
    nibbles = nibble_pairs(b[:, 32:48])
    return _iq1_codes(b[:, :32].astype(np.uint16) | ((nibbles & 7).astype(np.uint16) << 8), (nibbles & 8) != 0)


def _iq1_m_affine(b: np.ndarray) -> Affine:
    n = len(b)
    words = np.ascontiguousarray(b[:, 48:56]).view(np.uint16)
    d = (words & np.uint16(0xF000)) >> np.array([12, 8, 4, 0], dtype=np.uint16)
    d = (d[:, 0] | d[:, 1] | d[:, 2] | d[:, 3]).view(np.float16).astype(np.float32).reshape(n, 1)
    scales = ((words[..., None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7).reshape(n, 16)
    return d * (2 * scales + 1) * np.float32(0.125), None


GRID_CODES: dict[QType, BlockCodes] = {
    QType.IQ2_XXS: BlockCodes("int8", 32, False, _iq2_xxs_codes, _iq2_xxs_affine),
    QType.IQ2_XS: BlockCodes("int8", 16, False, _iq2_xs_codes, lambda b: _iq2_scales(b, 66)),
    QType.IQ2_S: BlockCodes("int8", 16, False, _iq2_s_codes, lambda b: _iq2_scales(b, 74)),
    QType.IQ3_XXS: BlockCodes("int8", 32, False, _iq3_xxs_codes, _iq3_xxs_affine),
    QType.IQ3_S: BlockCodes("int8", 32, False, _iq3_s_codes, _iq3_s_affine),
    QType.IQ1_S: BlockCodes("int8", 32, False, _iq1_s_codes, _iq1_s_affine),
    QType.IQ1_M: BlockCodes("int8", 16, False, _iq1_m_codes, _iq1_m_affine),
}
