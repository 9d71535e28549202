"""int4/int8 weight-only matmul for decode over a layout the weight is given once, at load.

A decode step multiplies a few activation rows by every weight, so it costs the time to stream the
weights. The first kernel (quant_matmul.py) reads the file's [N, K] codes and turns each into a float
with an int-to-float instruction, which Hopper issues at 16 per clock per SM (the CUDA guide's
throughput table): 4.2 G conversions/ms on an H200 against the 8.6 G int4 codes/ms its 4.3 TB/s
deliver, which is why int4 ran at under half of int8's speed (quant-gemm-cuda-2026-12-02.json).
`PackedQuantWeight` lays the same codes out so that a code costs two cheap instructions:

* Codes are int32 words, [N, K_pad / E] (E = 32 / bits codes a word, K padded to whole tiles): a
  thread's 16-byte load is 4 words of one output row, and a row's words run on from tile to tile.
* Inside each tile of TILE_K = E * SLOT inputs (SLOT = 16 words), code i of word j holds input
  k0 + i * SLOT + j. Code i of a [BLOCK_N, SLOT] block of words therefore pairs with the contiguous
  activations x[k0 + i * SLOT:][:SLOT], and a thread's 4 words with 4 contiguous activations (one
  vector load): no shuffle pairs weights with activations.
* A code becomes an exact float by OR-ing its bit field into the mantissa of 2^23 (one LOP3) and one
  FMA that scales the field down and subtracts 2^23 (`_code`). int8 codes are stored biased by 128,
  so every code is an unsigned field.
* Scales and zeros stay float32 (as in QuantizedWeight) but transposed to [groups, N], and apply
  once per group and tile: sum_k (q s + z) x = s sum_k q x + z sum_k x (per-channel: once per program).

Compiled for sm_90 (Triton 3.6, the H200's, and 3.9, through ptxas and cuobjdump without a GPU),
the "fma" loop spends 5.4-5.6 instructions per int4 code (2.1 FFMA, 1.1-2 LOP3, no I2F) and the
"dot" loop 5.0-5.7: issue-bound at about 3 TB/s of int4 weights on an H200, against the first
kernel's measured 0.44 TB/s; int8 codes cost about the same per code at twice the bytes, so int8
can reach bandwidth.

Three variants read the layout. "fma": one activation row per program, products on the FMA units into
a [BLOCK_N, SLOT] accumulator that is reduced across K once, at the end; for one or a few rows.
"dot": a tensor-core tl.dot per code slot (K = SLOT = 16, tl.dot's minimum) over BLOCK_M >= 16 rows.
"mma": the same products with the operands swapped, the weight tile as the tensor cores' M side (an
output row per MMA row) and up to 16 activation rows as their N side, so that on Hopper the decoded
codes feed wgmma straight from registers (the "dot" variant's weight operand goes through shared memory).
Its int4 codes become bf16 (or fp16) pairs in PTX (`_int4_pairs_asm`): two words' fields, byte-permuted
so that inputs k and k + 1 share a 32-bit register as the MMA wants them, each OR-ed into the mantissa of
128.0 (fp16: 1024.0), one PRMT, SHF or LOP3 a code, 128 + u exactly; the zero term takes the 128 off
through the activations' sums. Compiled for sm_90 (Triton 3.9), gate_up's K loop at BLOCK_N = 128 runs
414 instructions a thread per 128 codes, 3.2 a code against the "fma" loop's 5.4 (2.5 at BLOCK_N = 256).
With split-K each program writes an fp32 partial; the last program of an output tile to finish (an
atomic counter, reset by that program so CUDA graph replays find it zero) sums the partials in
split order: deterministic, and no second kernel launch. Configs per (kind, N, K, M) come from the
table benchmarks/quant_gemm.py measures (`CONFIG_TABLE`), else from `choose_packed_config`'s rule.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ember.kernels.paged import dot_dtype, dot_precision, num_sms
from ember.kernels.quant_matmul import matmul_output
from ember.kernels.split_k import MAX_TILES, sum_splits, tile_counters
from ember.quant.formats import QuantizedWeight, packed, unpack_int4

SLOT = 16  # words down K per code slot: tl.dot's minimum K, and a group size every supported form divides
_BITS = {"int4": 4, "int8": 8}
_BIAS = {"int4": 0, "int8": 128}  # int8 codes are stored as q + 128
_PACK_ROWS = 4096  # output rows packed at a time, bounding the int64 scratch to 4096 x K_pad x 8 bytes
_MAX_SPLIT_K = 32
_PROGRAMS_PER_SM = 4  # what the default split aims for: enough loads in flight to cover HBM latency
_DEQUANT_BLOCK_N = 64
FMA, DOT, MMA = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # the variants, as the kernel's MODE
_MODES = {"fma": FMA, "dot": DOT, "mma": MMA}
CONFIG_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quant_packed_configs.json")


@dataclass(frozen=True)
class PackedQuantWeight:
    """A QuantizedWeight's codes, scales and zeros in the kernel's layout (see the module docstring);
    made by `pack_weight`, the same weight exactly."""

    kind: str  # "int4" or "int8"
    qweight: torch.Tensor  # int32 [N, K_pad / (32 / bits)]
    scales: torch.Tensor  # float32 [num_groups, N]
    zeros: torch.Tensor | None  # float32 [num_groups, N]
    group_size: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def num_groups(self) -> int:
        return self.scales.shape[0]

    @property
    def bits(self) -> int:
        return _BITS[self.kind]

    @property
    def tile_k(self) -> int:
        return _tile_k(self.kind)

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])


def packable(w: QuantizedWeight) -> bool:
    """int4/int8 weights whose groups each cover whole code slots (every group size that is a
    multiple of 16, per-channel scales, every GGUF form); others keep to quant_matmul."""
    return w.kind in _BITS and w.block_rows == 1 and (w.group_size % SLOT == 0 or w.num_groups == 1)


def _tile_k(kind: str) -> int:
    return 32 // _BITS[kind] * SLOT


def pack_weight(w: QuantizedWeight) -> PackedQuantWeight:
    """The weight in the packed kernel's layout, made once at load (on the weight's device); a `runs` weight
    (GGUF Q4_1 as stored) from Ember's int4 packing of it."""
    w = packed(w)
    if not packable(w):
        raise ValueError(
            f"cannot pack a {w.kind} weight with groups of {w.group_size} (block_rows "
            f"{w.block_rows}) for the packed kernel"
        )
    bits, k, tile_k = _BITS[w.kind], w.in_features, _tile_k(w.kind)
    per_word, k_pad = 32 // bits, triton.cdiv(w.in_features, tile_k) * tile_k
    shifts = torch.arange(per_word, device=w.qweight.device).view(1, 1, per_word, 1) * bits
    chunks = [torch.empty(0, k_pad // per_word, dtype=torch.int32, device=w.qweight.device)]
    for start in range(0, w.out_features, _PACK_ROWS):
        rows = w.qweight[start : start + _PACK_ROWS]
        u = (unpack_int4(rows, k) if w.kind == "int4" else rows).to(torch.int64) + _BIAS[w.kind]
        u = F.pad(u, (0, k_pad - k)).view(rows.shape[0], k_pad // tile_k, per_word, SLOT)
        words = (u << shifts).sum(dim=2)  # [rows, tiles, SLOT]: input t * tile_k + i * SLOT + j in field i
        words = torch.where(words >= 2**31, words - 2**32, words)
        chunks.append(words.view(rows.shape[0], -1).to(torch.int32))
    return PackedQuantWeight(
        w.kind,
        torch.cat(chunks),
        w.scales.t().contiguous(),
        None if w.zeros is None else w.zeros.t().contiguous(),
        w.group_size,
        k,
    )


class PackedConfig(NamedTuple):
    variant: str  # "fma" (block_m 1), "dot" or "mma" (block_m >= 16)
    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int


@functools.cache
def _table(path: str) -> dict[tuple[str, int, int], list[tuple[int, PackedConfig]]]:
    """The measured configs (benchmarks/quant_gemm.py writes them): per (kind, N, K), (M, config)
    sorted by M. A missing or unreadable file leaves every shape to the heuristic."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)["entries"]
    except (OSError, ValueError, KeyError):
        return {}
    table: dict[tuple[str, int, int], list[tuple[int, PackedConfig]]] = {}
    for e in entries:
        table.setdefault((e["kind"], e["n"], e["k"]), []).append((e["m"], PackedConfig(**e["config"])))
    return {key: sorted(rows) for key, rows in table.items()}


def choose_packed_config(m: int, n: int, k: int, kind: str, sms: int, table_path: str = CONFIG_TABLE) -> PackedConfig:
    """The table's entry for the smallest tuned M at or above m (else the largest tuned M), or the
    heuristic: one-row FMA programs for M <= 2, 16-row tensor-core tiles above, and split-K until
    about _PROGRAMS_PER_SM programs per SM."""
    rows = _table(table_path).get((kind, n, k))
    if rows:
        return next((cfg for tuned_m, cfg in rows if tuned_m >= m), rows[-1][1])
    if m <= 2:
        variant, block_m, block_n = "fma", 1, 128
    else:
        variant, block_m, block_n = "dot", min(64, max(16, triton.next_power_of_2(m))), 64
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, _tile_k(kind))
    split_k = max(1, min(triton.cdiv(_PROGRAMS_PER_SM * sms, tiles), k_tiles, _MAX_SPLIT_K))
    return PackedConfig(variant, block_m, block_n, split_k, 4, 2)


@triton.jit
def _code(words, I: tl.constexpr, BITS: tl.constexpr, BIAS: tl.constexpr):
    """Field I of every word as an exact fp32 code (the stored value minus BIAS).

    The field is OR-ed into the mantissa of 2^23 (fields that would reach bit 23 are first shifted
    down by 16), which reads as 2^23 + u * 2^SHIFT; one FMA scales by 2^-SHIFT and subtracts
    2^(23 - SHIFT) + BIAS, both steps exact."""
    HIGH: tl.constexpr = I * BITS + BITS > 23
    SHIFT: tl.constexpr = I * BITS - 16 * HIGH
    field = ((words >> (16 * HIGH)) & (((1 << BITS) - 1) << SHIFT)) | 0x4B000000
    return field.to(tl.float32, bitcast=True) * (2.0**-SHIFT) - (2.0 ** (23 - SHIFT) + BIAS)


def _int4_pairs_asm(magic: int) -> str:
    """PTX for two int32 words (codes of inputs k and k + 1 of one output row, as the tensor cores pair them)
    to eight 16-bit float pairs, field i of both words in pair i: each 16-bit half of a byte permutation,
    masked to one field and OR-ed into the mantissa of `magic` (128.0 in bf16, 1024.0 in fp16), reads as
    magic + u, exactly. One PRMT, SHF or LOP3 a code."""
    lines = ["prmt.b32 lo, $8, $9, 0x5410;", "prmt.b32 hi, $8, $9, 0x7632;"]
    for half, base in (("lo", 0), ("hi", 4)):
        for i in range(4):
            src = half if i == 0 else "t"
            if i:
                lines.append(f"shr.u32 t, {half}, {4 * i};")
            lines.append(f"lop3.b32 ${base + i}, {src}, 0x000F000F, {magic:#010x}, 0xEA;")
    return "{\n.reg .b32 lo, hi, t;\n" + "\n".join(lines) + "\n}"


# Per activation dtype: the value int4 codes carry into the "mma" variant's tensor cores, and the PTX that
# gives it (fp32 activations take plain Triton ops, with 128)
_INT4_PAIRS = {torch.bfloat16: (128, _int4_pairs_asm(0x43004300)), torch.float16: (1024, _int4_pairs_asm(0x64006400))}


@triton.jit
def _asm_pairs(words, ASM: tl.constexpr, BF16: tl.constexpr):
    """The PTX's eight outputs (tl.inline_asm_elementwise takes its dtypes written out, not as arguments)."""
    if BF16:
        codes = tl.inline_asm_elementwise(
            ASM,
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r",
            [words],
            dtype=(
                tl.bfloat16,
                tl.bfloat16,
                tl.bfloat16,
                tl.bfloat16,
                tl.bfloat16,
                tl.bfloat16,
                tl.bfloat16,
                tl.bfloat16,
            ),
            is_pure=True,
            pack=2,
        )
    else:
        codes = tl.inline_asm_elementwise(
            ASM,
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r",
            [words],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=2,
        )
    return codes


@triton.jit
def _tile_codes(
    words, BITS: tl.constexpr, BIAS: tl.constexpr, ASM: tl.constexpr, OFFSET: tl.constexpr, DOT_DTYPE: tl.constexpr
):
    """A tile's code slots for the "mma" variant, a tuple of [BLOCK_N, SLOT] tensors: int4 slots as OFFSET + u
    (in DOT_DTYPE through the PTX `ASM` where given, else fp32 through _code with the offset in its bias, the
    same values), int8 slots as their codes."""
    if BITS == 4:
        if ASM != "":
            codes = _asm_pairs(words, ASM, DOT_DTYPE == tl.bfloat16)
        else:
            codes = (
                _code(words, 0, BITS, BIAS - OFFSET),
                _code(words, 1, BITS, BIAS - OFFSET),
                _code(words, 2, BITS, BIAS - OFFSET),
                _code(words, 3, BITS, BIAS - OFFSET),
                _code(words, 4, BITS, BIAS - OFFSET),
                _code(words, 5, BITS, BIAS - OFFSET),
                _code(words, 6, BITS, BIAS - OFFSET),
                _code(words, 7, BITS, BIAS - OFFSET),
            )
    else:
        codes = (
            _code(words, 0, BITS, BIAS),
            _code(words, 1, BITS, BIAS),
            _code(words, 2, BITS, BIAS),
            _code(words, 3, BITS, BIAS),
        )
    return codes


@triton.jit
def _row_sums(x_ptr, offs_m, m_mask, k0, K, stride_xm, WIDTH: tl.constexpr, EVEN_K: tl.constexpr):
    """sum over x[m, k0:k0 + WIDTH] per activation row ([BLOCK_M], fp32): the "mma" variant's zero-term factor."""
    offs_k = k0 + tl.arange(0, WIDTH)
    ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    if EVEN_K:
        x = tl.load(ptrs, mask=m_mask[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)
    return tl.sum(x.to(tl.float32), axis=1)


@triton.jit
def _zero_term(x_sum, scale, z_ptrs, n_mask, HAS_ZEROS: tl.constexpr, OFFSET: tl.constexpr, MODE: tl.constexpr):
    """x_sum times each column's zero, less OFFSET scales (the "mma" variant's codes carry OFFSET)."""
    if HAS_ZEROS:
        zero = tl.load(z_ptrs, mask=n_mask, other=0.0)
        if OFFSET != 0:
            zero -= OFFSET * scale
    else:
        zero = -OFFSET * scale
    return _outer(x_sum, zero, MODE)


@triton.jit
def _per_n(a, v, MODE: tl.constexpr):
    """a times v[n] along its output-column axis (1 for "dot" [M, N], 0 for "fma" [N, SLOT] and "mma" [N, M])."""
    if MODE == DOT:
        out = a * v[None, :]
    else:
        out = a * v[:, None]
    return out


@triton.jit
def _outer(x, v, MODE: tl.constexpr):
    """x (activation sums per row, [BLOCK_M, BLOCK_N] for "dot", [BLOCK_M] for "mma", or per lane, [SLOT])
    times v[n], shaped like the accumulator."""
    if MODE == DOT:
        out = x * v[None, :]
    elif MODE == MMA:
        out = x[None, :] * v[:, None]
    else:
        out = v[:, None] * x[None, :]
    return out


@triton.jit
def _slots(
    part,
    x_sum,
    words,
    codes,
    x_ptr,
    offs_m,
    m_mask,
    offs_j,
    row,
    t,
    K,
    stride_xm,
    FIRST: tl.constexpr,
    COUNT: tl.constexpr,
    BITS: tl.constexpr,
    BIAS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    MODE: tl.constexpr,
    EVEN_K: tl.constexpr,
    SLOT_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Add code slots FIRST.. FIRST + COUNT of tile t, unscaled, to `part` ([BLOCK_N, SLOT_K] per-lane
    products for "fma", [BLOCK_M, BLOCK_N] for "dot", [BLOCK_N, BLOCK_M] for "mma"), and, with HAS_ZEROS,
    their activations to `x_sum` (the zero term's factor: [SLOT_K] per lane for "fma", [BLOCK_M, BLOCK_N]
    per row for "dot"; "mma" leaves it to its caller, which sums the rows once a group with _row_sums)."""
    TILE_K: tl.constexpr = 32 // BITS * SLOT_K
    for e in tl.static_range(COUNT):
        offs_k = t * TILE_K + (FIRST + e) * SLOT_K + offs_j
        if MODE != MMA:
            q = _code(words, FIRST + e, BITS, BIAS)
        if MODE == DOT:
            x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            else:
                x = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)
            part = tl.dot(x.to(DOT_DTYPE), tl.trans(q.to(DOT_DTYPE)), part, input_precision=PRECISION)
            if HAS_ZEROS:  # row sums, already broadcast over N, from the tensor cores rather than shuffles
                ones = tl.full([SLOT_K, part.shape[1]], 1.0, DOT_DTYPE)
                x_sum = tl.dot(x.to(DOT_DTYPE), ones, x_sum, input_precision=PRECISION)
        elif MODE == MMA:  # the tensor cores' M is the weight's N; x_sum is the caller's (_row_sums)
            x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            else:
                x = tl.load(x_ptrs, mask=m_mask[None, :] & (offs_k[:, None] < K), other=0.0)
            part = tl.dot(codes[FIRST + e].to(DOT_DTYPE), x.to(DOT_DTYPE), part, input_precision=PRECISION)
        else:
            if EVEN_K:
                x = tl.load(x_ptr + row * stride_xm + offs_k).to(tl.float32)
            else:
                x = tl.load(x_ptr + row * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            part += q * x[None, :]
            if HAS_ZEROS:
                x_sum += x
    return part, x_sum


@triton.jit
def _packed_matmul_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    num_groups,
    tiles_per_split,
    num_tiles,
    row_words,
    stride_xm,
    stride_om,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    BIAS: tl.constexpr,
    SLOTS_PER_GROUP: tl.constexpr,
    ONE_GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    MODE: tl.constexpr,
    ASM: tl.constexpr,
    OFFSET: tl.constexpr,
    SUMS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLOT_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile over K tiles [pid_k * tiles_per_split, ...). ONE_GROUP
    (per-channel scales): products accumulate unscaled and the scale applies once, at the end.
    EVEN_K (K a whole number of tiles, as in every Llama-3.1-8B layer): activation loads unmasked."""
    PER_WORD: tl.constexpr = 32 // BITS
    TILE_K: tl.constexpr = PER_WORD * SLOT_K
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, SLOT_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    row = pid_m.to(tl.int64)  # the "fma" variant's one activation row
    if MODE == DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        x_total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    elif MODE == MMA:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        x_total = tl.zeros([BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, SLOT_K], tl.float32)
        x_total = tl.zeros([SLOT_K], tl.float32)
    t_start = pid_k * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, num_tiles)
    word_ptrs = q_ptr + offs_n[:, None].to(tl.int64) * row_words + offs_j[None, :]
    if MODE == FMA:
        # The FMA variant loads each tile's words one iteration ahead, so two loads per program are in
        # flight: its loads feed no tl.dot, so Triton's pipeliner leaves them alone. (Compiled for
        # sm_90: 128 registers against 96, 5.4 instructions per int4 code either way.) Two or three
        # tiles ahead, in a queue of registers, measured 3-12% slower at M = 1 for Llama-3.1-8B's
        # gate_up and down on the H200 (178 registers at 8 warps: one program per SM; 2026-12-07,
        # quant-gemm-int4-m1-h200-2026-12-07.json).
        next_words = tl.load(word_ptrs + t_start * SLOT_K, mask=n_mask[:, None], other=0)
    for t in range(t_start, t_end):
        if MODE != FMA:
            words = tl.load(word_ptrs + t * SLOT_K, mask=n_mask[:, None], other=0)
        else:
            words = next_words
            # (the last iteration reloads its own tile, which is in cache, rather than masking)
            next_words = tl.load(word_ptrs + tl.minimum(t + 1, t_end - 1) * SLOT_K, mask=n_mask[:, None], other=0)
        if MODE == MMA:
            codes = _tile_codes(words, BITS, BIAS, ASM, OFFSET, DOT_DTYPE)
        else:
            codes = words
        if ONE_GROUP:
            acc, x_total = _slots(
                acc,
                x_total,
                words,
                codes,
                x_ptr,
                offs_m,
                m_mask,
                offs_j,
                row,
                t,
                K,
                stride_xm,
                0,
                PER_WORD,
                BITS,
                BIAS,
                HAS_ZEROS,
                MODE,
                EVEN_K,
                SLOT_K,
                DOT_DTYPE,
                PRECISION,
            )
            if MODE == MMA and SUMS:
                x_total += _row_sums(x_ptr, offs_m, m_mask, t * TILE_K, K, stride_xm, TILE_K, EVEN_K)
        else:
            for b in tl.static_range(PER_WORD // SLOTS_PER_GROUP):
                part, x_sum = _slots(
                    tl.zeros_like(acc),
                    tl.zeros_like(x_total),
                    words,
                    codes,
                    x_ptr,
                    offs_m,
                    m_mask,
                    offs_j,
                    row,
                    t,
                    K,
                    stride_xm,
                    b * SLOTS_PER_GROUP,
                    SLOTS_PER_GROUP,
                    BITS,
                    BIAS,
                    HAS_ZEROS,
                    MODE,
                    EVEN_K,
                    SLOT_K,
                    DOT_DTYPE,
                    PRECISION,
                )
                k0 = t * TILE_K + b * SLOTS_PER_GROUP * SLOT_K
                if MODE == MMA and SUMS:
                    x_sum = _row_sums(x_ptr, offs_m, m_mask, k0, K, stride_xm, SLOTS_PER_GROUP * SLOT_K, EVEN_K)
                # A block wholly in K's padding has zero activations; clamping keeps its loads in bounds.
                group = tl.minimum(k0 // GROUP, num_groups - 1)
                scale = tl.load(s_ptr + group * N + offs_n, mask=n_mask, other=0.0)
                acc += _per_n(part, scale, MODE)
                if SUMS:
                    acc += _zero_term(x_sum, scale, z_ptr + group * N + offs_n, n_mask, HAS_ZEROS, OFFSET, MODE)
    if ONE_GROUP:
        scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
        acc = _per_n(acc, scale, MODE)
        if SUMS:
            acc += _zero_term(x_total, scale, z_ptr + offs_n, n_mask, HAS_ZEROS, OFFSET, MODE)
    if MODE == DOT:
        result = acc
    elif MODE == MMA:
        result = tl.trans(acc)
    else:
        result = tl.sum(acc, axis=1)[None, :]

    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        result, is_last = sum_splits(result, part_ptr, count_ptr, offs_m, offs_n, out_mask, M, N)
    else:
        is_last = True
    if is_last:
        if HAS_BIAS:
            result += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, result.to(out_ptr.dtype.element_ty), mask=out_mask)


def _slots_per_group(w: PackedQuantWeight) -> int:
    """Code slots of a tile that share one group's scale: all of them when groups cover whole tiles
    (or there is one group), g / 16 when tiles hold whole groups, else one (a group of 48, say)."""
    per_word = 32 // w.bits
    if w.num_groups == 1 or w.group_size % w.tile_k == 0:
        return per_word
    if w.tile_k % w.group_size == 0:
        return w.group_size // SLOT
    return 1


def packed_matmul(
    x: torch.Tensor, w: PackedQuantWeight, bias: torch.Tensor | None = None, config: PackedConfig | None = None
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x.dtype. `config` overrides choose_packed_config."""
    m, k = x.shape
    n = w.out_features
    out = matmul_output("packed_matmul", x, w.in_features, n)
    if m == 0 or n == 0:
        return out
    cfg = config or choose_packed_config(m, n, k, w.kind, num_sms(x.device))
    if (cfg.variant == "fma") != (cfg.block_m == 1) or cfg.variant not in _MODES:
        raise ValueError(
            f"packed_matmul: config {cfg} must be 'fma' with block_m 1 or 'dot' or 'mma' with block_m >= 16"
        )
    num_tiles = w.qweight.shape[1] // SLOT
    grid_m, grid_n = triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n)
    tiles_per_split = triton.cdiv(num_tiles, max(1, cfg.split_k))
    split_k = triton.cdiv(num_tiles, tiles_per_split)
    if grid_m * grid_n > MAX_TILES:
        tiles_per_split, split_k = num_tiles, 1
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    zeros = w.zeros if w.zeros is not None else w.scales
    # int4 codes reach the "mma" variant's tensor cores as offset + u (_tile_codes); the zero term takes it off
    offset, asm = 0, ""
    if cfg.variant == "mma" and w.kind == "int4":
        offset, asm = _INT4_PAIRS.get(x.dtype, (128, ""))
        asm = "" if triton.knobs.runtime.interpret else asm
    _packed_matmul_kernel[(grid_m, grid_n, split_k)](
        x,
        w.qweight,
        w.scales,
        zeros,
        bias if bias is not None else out,
        out,
        part,
        tile_counters(x.device),
        m,
        n,
        k,
        w.num_groups,
        tiles_per_split,
        num_tiles,
        w.qweight.shape[1],
        x.stride(0),
        out.stride(0),
        GROUP=w.group_size,
        BITS=w.bits,
        BIAS=_BIAS[w.kind],
        SLOTS_PER_GROUP=_slots_per_group(w),
        ONE_GROUP=w.num_groups == 1,
        HAS_ZEROS=w.zeros is not None,
        HAS_BIAS=bias is not None,
        SPLIT=split_k > 1,
        MODE=_MODES[cfg.variant],
        ASM=asm,
        OFFSET=offset,
        SUMS=w.zeros is not None or offset != 0,
        EVEN_K=k % w.tile_k == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SLOT_K=SLOT,
        DOT_DTYPE=dot_dtype(x.dtype),
        PRECISION=dot_precision(x.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


@triton.jit
def _dequantize_packed_kernel(
    q_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    K,
    num_groups,
    row_words,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    BIAS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLOT_K: tl.constexpr,
):
    """Rows pid(0) * BLOCK_N.., K tile pid(1) of the dense W [N, K]: q * scale, then + zero."""
    PER_WORD: tl.constexpr = 32 // BITS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.program_id(1)
    offs_j = tl.arange(0, SLOT_K)
    n_mask = offs_n < N
    words = tl.load(
        q_ptr + offs_n[:, None].to(tl.int64) * row_words + (t * SLOT_K + offs_j)[None, :], mask=n_mask[:, None], other=0
    )
    for i in tl.static_range(PER_WORD):
        offs_k = t * PER_WORD * SLOT_K + i * SLOT_K + offs_j
        group = offs_k[None, :] // GROUP
        mask = n_mask[:, None] & (offs_k[None, :] < K)
        g_mask = mask & (group < num_groups)
        w = _code(words, i, BITS, BIAS) * tl.load(s_ptr + group * N + offs_n[:, None], mask=g_mask, other=0.0)
        if HAS_ZEROS:
            w += tl.load(z_ptr + group * N + offs_n[:, None], mask=g_mask, other=0.0)
        tl.store(
            out_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask
        )


def dequantize_packed(w: PackedQuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense [N, K] weight, equal to formats.dequantize bit for bit (multiply and add round
    separately, as PyTorch's do), for batches where dequantize + cuBLAS beats the fused kernel."""
    n, k = w.out_features, w.in_features
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    if out.numel() == 0:
        return out
    zeros = w.zeros if w.zeros is not None else w.scales
    _dequantize_packed_kernel[(triton.cdiv(n, _DEQUANT_BLOCK_N), w.qweight.shape[1] // SLOT)](
        w.qweight,
        w.scales,
        zeros,
        out,
        n,
        k,
        w.num_groups,
        w.qweight.shape[1],
        GROUP=w.group_size,
        BITS=w.bits,
        BIAS=_BIAS[w.kind],
        HAS_ZEROS=w.zeros is not None,
        BLOCK_N=_DEQUANT_BLOCK_N,
        SLOT_K=SLOT,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out
