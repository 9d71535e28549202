"""Per-type decoding of GGUF blocks into integer codes and per-group affine terms (numpy).

Every GGUF type decoded here is, element for element, `q * scale + zero` with integer codes q and
one float32 scale (and zero term) per group of 16, 32 or 256 elements, computed by the same float32
operations llama.cpp's reference (`gguf.quants`) uses. That is Ember's QuantizedWeight form, so
gguf_blocks can either evaluate it (float decode) or keep it (quantized weights) from one decoder.

Codes and affine terms are separate functions: the quantized path never materialises unpacked
nibbles for the 4-bit types (see `pack_split_nibbles`), and the float path never packs.
Non-linear code books (IQ4_NL, IQ4_XS, MXFP4) fit too, as their tables hold integers: the code is
the table entry, not the index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.quants import IQ4_NL, MXFP4

from ember.quant.formats import INT5_RUN_BYTES, int5_values

Affine = tuple[np.ndarray, np.ndarray | None]  # float32 scales [blocks, groups], zero terms or None
# A K-quant's affine terms as factors: (float16-valued float32 base [blocks, 1], int8 codes [blocks, groups])
# for the scales and, where there are zeros, for them; base * codes is the Affine term bit for bit.
Factors = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]

_IQ4_VALUES = np.array(IQ4_NL.kvalues, dtype=np.int8)
_FP4_VALUES = np.array(MXFP4.kvalues, dtype=np.int8)  # e2m1 values doubled: integers in [-12, 12]
_TERNARY_POWERS = np.array([1, 3, 9, 27, 81], dtype=np.uint8)[:, None]
_CRUMB_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]


def fp16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """An fp16 field at byte `start` of every block, as a float32 column for broadcasting."""
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


def _fp16_at(offset: int) -> Callable[[np.ndarray], Affine]:
    """The affine terms of a symmetric type with one fp16 scale per block at byte `offset`."""
    return lambda b: (fp16_field(b, offset), None)


def nibble_pairs(packed: np.ndarray) -> np.ndarray:
    """4-bit fields of [n, m] bytes, low nibble first: [n, 2m] (scale fields)."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(len(packed), -1)


def _split_nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes [n, ..., r] holding element j in the low and element j + r in the high nibble of byte j
    (every GGUF 4-bit layout) -> uint8 codes [n, ... * 2r] in element order."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-2).reshape(len(packed), -1)


_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)


def pack_split_nibbles(packed: np.ndarray, run: int, out: np.ndarray | None = None) -> np.ndarray:
    """The same bytes re-laid out as Ember's int4 packing (element 2j low, 2j + 1 high nibble of byte j),
    written into `out` (uint8, the shape of `packed`) when given.

    Output byte j of a run's first half is the low nibbles of bytes 2j and 2j + 1, of its second
    half their high nibbles. On 64-bit words, `m | m >> 4` of the masked nibbles leaves each such
    pair in the low byte of a 16-bit lane, which a narrowing copy extracts: 5x faster than the same
    work on uint16 byte pairs and never unpacking to one code per byte (which was 80% of the default
    model's weight decoding time). Two scratch arrays serve every step.
    """
    n = len(packed)
    words = np.ascontiguousarray(packed).view(np.uint64)
    out = np.empty(packed.shape, dtype=np.uint8) if out is None else out
    halves = out.reshape(n, -1, 2, run // 2)
    nibbles, spare = np.empty_like(words), np.empty_like(words)
    for half in range(2):
        np.bitwise_and(words >> np.uint64(4) if half else words, _LOW_NIBBLES, out=nibbles)
        np.right_shift(nibbles, np.uint64(4), out=spare)
        nibbles |= spare
        np.copyto(halves[:, :, half], nibbles.view(np.uint16).reshape(n, -1, run // 2), casting="unsafe")
    return out


def _bits(packed: np.ndarray) -> np.ndarray:
    """Bit k of byte j -> element 8j + k, as uint8 0/1 [n, 8 * bytes] (little-endian bit order)."""
    return np.unpackbits(packed, axis=-1, bitorder="little")


def _crumbs(packed: np.ndarray) -> np.ndarray:
    """2-bit fields of [n, h * 32] bytes: element 128i + 32s + l is bits 2s..2s+1 of byte 32i + l."""
    return ((packed.reshape(len(packed), -1, 1, 32) >> _CRUMB_SHIFTS) & 3).reshape(len(packed), -1)


# --- 32-element blocks --------------------------------------------------------------------------


def _q8_0_codes(b: np.ndarray) -> np.ndarray:  # [d: fp16][32 x int8]
    return b[:, 2:].view(np.int8)


def _q4_0_affine(b: np.ndarray) -> Affine:  # [d: fp16][16 bytes of split nibbles]: d * (q - 8)
    d = fp16_field(b, 0)
    return d, d * np.float32(-8)


def _q4_1_affine(b: np.ndarray) -> Affine:  # [d: fp16][m: fp16][16 bytes of split nibbles]: d * q + m
    return fp16_field(b, 0), fp16_field(b, 2)


def _q5_codes(b: np.ndarray, start: int, offset: int) -> np.ndarray:
    # An int5 run (ember/quant/formats.py) from byte `start` on: Q5_0's codes q - 16, Q5_1's q.
    q = int5_values(b[:, start : start + INT5_RUN_BYTES])
    return q.view(np.int8) - np.int8(offset) if offset else q.view(np.int8)


def _q5_0_runs(b: np.ndarray, out: np.ndarray) -> None:
    """Q5_0's blocks are its int5 runs after a float16 scale: kept as they are, one strided copy. For a
    Qwen2-0.5B Q4_K_M file's 132 Q5_0 matrices (2-core EPYC) decoding them to int8 and packing that to
    int5 took 0.83-0.95 s of its 3.0-3.4 s start-up, this copy (with the scales) 0.08-0.11 s (issue 30)."""
    np.copyto(out, b[:, 2 : 2 + INT5_RUN_BYTES])


def _iq4_nl_codes(b: np.ndarray) -> np.ndarray:  # [d: fp16][16 bytes of split nibbles indexing the table]
    return _IQ4_VALUES[_split_nibbles(b[:, 2:])]


def _mxfp4_codes(b: np.ndarray) -> np.ndarray:  # [e: e8m0][16 bytes of split nibbles indexing e2m1 * 2]
    return _FP4_VALUES[_split_nibbles(b[:, 1:])]


def _mxfp4_affine(b: np.ndarray) -> Affine:
    return MXFP4.e8m0_to_fp32_half(b[:, :1]), None


# --- 256-element super-blocks -------------------------------------------------------------------

_SIX_BITS, _LOW_FOUR, _TOP_TWO = np.uint32(0x3F3F3F3F), np.uint32(0x0F0F0F0F), np.uint32(0x30303030)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte field of 8 six-bit scales and 8 six-bit mins used by Q4_K and Q5_K.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; for sub-blocks 4-7 the
    low 4 bits sit in bytes 8-11 (scale low nibble, min high nibble) and the top 2 bits are the
    spare high bits of bytes 0-3 (scales) and 4-7 (mins). Worked on as three 32-bit words per block
    (four fields at once): numpy's loops over 4-byte rows made the byte-wise version 1.9x slower.
    """
    words = packed.view(np.uint32)  # [blocks, 3]: scales 0-3, mins 0-3, low nibbles of 4-7
    low_sc, low_min, extra = words[:, 0], words[:, 1], words[:, 2]
    fields = np.empty((len(words), 4), dtype=np.uint32)  # scales 0-3, 4-7, mins 0-3, 4-7
    np.bitwise_and(low_sc, _SIX_BITS, out=fields[:, 0])
    np.bitwise_or(extra & _LOW_FOUR, (low_sc >> np.uint32(2)) & _TOP_TWO, out=fields[:, 1])
    np.bitwise_and(low_min, _SIX_BITS, out=fields[:, 2])
    np.bitwise_or((extra >> np.uint32(4)) & _LOW_FOUR, (low_min >> np.uint32(2)) & _TOP_TWO, out=fields[:, 3])
    both = fields.view(np.uint8).astype(np.float32)
    return both[:, :8], both[:, 8:]


def _k_affine(b: np.ndarray) -> Affine:
    """Q4_K/Q5_K sub-block scales d*sc and zero terms -(dmin*m).

    llama.cpp computes `d*sc * q - dmin*m`; IEEE defines a - b as a + (-b), so adding the negated
    min gives the same bits.
    """
    scales, mins = _k_scales(b[:, 4:16])
    return fp16_field(b, 0) * scales, -(fp16_field(b, 2) * mins)


def _k_factors(b: np.ndarray) -> Factors:
    """_k_affine's terms as factors: -(dmin * m) == (-dmin) * m, float32 products being sign-symmetric."""
    scales, mins = _k_scales(b[:, 4:16])
    return fp16_field(b, 0), scales.astype(np.int8), -fp16_field(b, 2), mins.astype(np.int8)


def _q5_k_codes(b: np.ndarray) -> np.ndarray:
    # [d][dmin][12 bytes scales][32 bytes: bit k of byte l is the fifth bit of element 32k + l]
    # [128 bytes: 4 runs of 32 split nibbles]. Codes 0..31 fit int8 as they are.
    n = len(b)
    high = _bits(b[:, 16:48]).reshape(n, 32, 8).transpose(0, 2, 1).reshape(n, 256)
    return (_split_nibbles(b[:, 48:].reshape(n, 4, 32)) | (high << 4)).view(np.int8)


def _q6_k_codes(b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """[128 bytes low nibbles][64 bytes high 2-bit pairs][16 x int8 scales][d: fp16]. Each half
    of 128 elements uses 64 low bytes (elements 0-63 low nibbles, 64-127 high nibbles) and 32
    high bytes (bit pair s of byte l belongs to element 32s + l).

    Built in place in one output array (`out`, int8 [blocks, 256], when given), quarter by quarter:
    1.2x faster end to end than combining whole unpacked arrays (Q6_K holds a Q4_K_M file's
    embedding and output). The high pairs are shifted as one contiguous copy (numpy's loops over
    32-byte rows of the strided field cost ~10% more CPU for the whole decode)."""
    n = len(b)
    low = b[:, :128].reshape(n, 2, 64)
    q = np.empty((n, 256), dtype=np.int8) if out is None else out
    q = q.view(np.uint8).reshape(n, 2, 2, 64)  # [block, half, nibble, 64]
    np.bitwise_and(low, 0x0F, out=q[:, :, 0])
    np.right_shift(low, 4, out=q[:, :, 1])
    high = np.ascontiguousarray(b[:, 128:192])
    high_up, pair = high << 4, np.empty_like(high)
    quarters = q.reshape(n, 2, 4, 32)  # element 32s + l of a half is quarters[:, :, s, l]
    for s in range(4):
        np.right_shift(high_up if s < 2 else high, 2 * s if s < 2 else 2 * s - 4, out=pair)
        pair &= 0x30
        quarters[:, :, s] |= pair.reshape(n, 2, 32)
    q -= 32  # wraps to the int8 codes q - 32
    return q.reshape(n, 256).view(np.int8)


def _q6_k_affine(b: np.ndarray) -> Affine:
    return fp16_field(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32), None


def _q6_k_factors(b: np.ndarray) -> Factors:
    return fp16_field(b, 208), b[:, 192:208].view(np.int8), None, None


def _q2_k_codes(b: np.ndarray) -> np.ndarray:  # [16 scale bytes][64 bytes of 2-bit codes][d][dmin]
    return _crumbs(b[:, 16:80])


def _q2_k_affine(b: np.ndarray) -> Affine:
    """16 sub-blocks: scale d * (low nibble), zero term -(dmin * high nibble); see _k_affine."""
    sc = b[:, :16]
    return fp16_field(b, 80) * (sc & 0x0F).astype(np.float32), -(fp16_field(b, 82) * (sc >> 4).astype(np.float32))


def _q3_k_codes(b: np.ndarray) -> np.ndarray:
    # [32 bytes hmask: bit (4i + s) of byte l set means no -4 on element 128i + 32s + l]
    # [64 bytes of 2-bit low parts][12 bytes scales][d]. Codes lie in -4..3.
    n = len(b)
    high = _bits(b[:, :32]).reshape(n, 32, 8).transpose(0, 2, 1).reshape(n, 256)
    return _crumbs(b[:, 32:96]).view(np.int8) - ((high ^ 1) << 2).view(np.int8)


def _q3_k_affine(b: np.ndarray) -> Affine:
    """16 six-bit signed scales: low 4 bits are nibbles of bytes 96-103 (scales 0-7 low, 8-15 high),
    top 2 bits are bit pairs of bytes 104-107 (pair s of byte j belongs to scale 4s + j)."""
    n = len(b)
    low = _split_nibbles(b[:, 96:104])
    high = ((b[:, None, 104:108] >> _CRUMB_SHIFTS) & 3).reshape(n, 16)
    scales = ((low | (high << 4)).view(np.int8) - np.int8(32)).astype(np.float32)
    return fp16_field(b, 108) * scales, None


def _iq4_xs_codes(
    b: np.ndarray,
) -> np.ndarray:  # [d][2 bytes high scales][4 bytes low scales][8 runs of 16 split nibbles]
    return _IQ4_VALUES[_split_nibbles(b[:, 8:].reshape(len(b), 8, 16))]


def _iq4_xs_affine(b: np.ndarray) -> Affine:
    """8 six-bit signed scales: nibble j % 2 of byte 4 + j // 2, plus bits 2j..2j+1 of the uint16 at byte 2."""
    low = nibble_pairs(b[:, 4:8])
    shifts = np.arange(0, 16, 2, dtype=np.uint16)
    high = ((b[:, 2:4].view(np.uint16) >> shifts) & 3).astype(np.uint8)
    scales = ((low | (high << 4)).view(np.int8) - np.int8(32)).astype(np.float32)
    return fp16_field(b, 0) * scales, None


def _tq1_0_codes(b: np.ndarray) -> np.ndarray:
    """[48 bytes, 5 base-3 digits each][4 bytes, 4 digits each][d]. A byte holds digits scaled into
    0..255 so that multiplying by 3^k (mod 256) brings digit k to the top: (x * 3) >> 8 reads it."""
    n = len(b)
    parts = [
        (b[:, None, :32] * _TERNARY_POWERS),
        (b[:, None, 32:48] * _TERNARY_POWERS),
        (b[:, None, 48:52] * _TERNARY_POWERS[:4]),
    ]
    digits = np.concatenate([p.reshape(n, -1) for p in parts], axis=1)
    return ((digits.astype(np.uint16) * 3) >> 8).astype(np.int8) - np.int8(1)


def _tq2_0_codes(b: np.ndarray) -> np.ndarray:  # [64 bytes of 2-bit codes q + 1][d]
    return _crumbs(b[:, :64]).view(np.int8) - np.int8(1)


class BlockCodes(NamedTuple):
    """How one GGUF type's blocks decode: `codes` gives int8 (or, for int4, uint8 0..15) codes
    [blocks, block size] in element order; `affine` the per-group scales and zero terms; `write`,
    where a type has a faster way, writes the QuantizedWeight's codes (Ember's int4 packing for int4,
    int5 runs for int5, straight from the file's bytes) into a given output, sparing a temporary and a
    copy per chunk; int5 has no other way."""

    kind: str  # QuantizedWeight kind that holds the codes: "int8", "int4" or "int5"
    group_size: int  # elements sharing one scale (and zero)
    has_zeros: bool
    codes: Callable[[np.ndarray], np.ndarray]
    affine: Callable[[np.ndarray], Affine]
    write: Callable[[np.ndarray, np.ndarray], object] | None = None
    factors: Callable[[np.ndarray], Factors] | None = None  # K-quants: `affine` as ScaleFactors


def _nibble_type(
    start: int,
    run: int,
    group_size: int,
    affine: Callable[[np.ndarray], Affine],
    factors: Callable[[np.ndarray], Factors] | None = None,
) -> BlockCodes:
    """An int4 type whose bytes from `start` on are runs of `run` split-nibble bytes."""
    return BlockCodes(
        "int4",
        group_size,
        True,
        lambda b: _split_nibbles(b[:, start:].reshape(len(b), -1, run)),
        affine,
        lambda b, out: pack_split_nibbles(b[:, start:], run, out),
        factors,
    )


BLOCK_CODES: dict[QType, BlockCodes] = {
    QType.Q8_0: BlockCodes("int8", 32, False, _q8_0_codes, _fp16_at(0)),
    QType.Q4_0: _nibble_type(2, 16, 32, _q4_0_affine),
    QType.Q4_1: _nibble_type(4, 16, 32, _q4_1_affine),
    QType.Q5_0: BlockCodes("int5", 32, False, lambda b: _q5_codes(b, 2, 16), _fp16_at(0), _q5_0_runs),
    QType.Q5_1: BlockCodes("int8", 32, True, lambda b: _q5_codes(b, 4, 0), _q4_1_affine),
    QType.IQ4_NL: BlockCodes("int8", 32, False, _iq4_nl_codes, _fp16_at(0)),
    QType.MXFP4: BlockCodes("int8", 32, False, _mxfp4_codes, _mxfp4_affine),
    QType.Q2_K: BlockCodes("int4", 16, True, _q2_k_codes, _q2_k_affine),
    QType.Q3_K: BlockCodes("int8", 16, False, _q3_k_codes, _q3_k_affine),
    QType.Q4_K: _nibble_type(16, 32, 32, _k_affine, _k_factors),
    QType.Q5_K: BlockCodes("int8", 32, True, _q5_k_codes, _k_affine, factors=_k_factors),
    QType.Q6_K: BlockCodes("int8", 16, False, _q6_k_codes, _q6_k_affine, _q6_k_codes, _q6_k_factors),
    QType.IQ4_XS: BlockCodes("int8", 32, False, _iq4_xs_codes, _iq4_xs_affine),
    QType.TQ1_0: BlockCodes("int8", 256, False, _tq1_0_codes, _fp16_at(52)),
    QType.TQ2_0: BlockCodes("int8", 256, False, _tq2_0_codes, _fp16_at(64)),
}
