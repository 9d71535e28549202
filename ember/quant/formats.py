"""The one in-memory form every quantized weight takes, whatever produced it.

Integer weights dequantize as `w[n, k] = q[n, k] * scales[n, k // g] + zeros[n, k // g]` (zeros
absent: symmetric). One affine form covers per-channel int8 (g = K), group-wise int4 and every
GGUF block type we map (Q4_1's min, Q4_0's implicit 8, the K-quants' sub-block scales and mins),
so kernels need no per-source cases. Scales and zeros are float32: GGUF scale products such as
`d * sc` need more mantissa than bf16 keeps, and float32 keeps GGUF decoding exact.

int5 codes are GGUF Q5_0's blocks without their float16 scale, kept as the file stores them: runs of 32
codes, 4 bytes of fifth bits (bit j of the little-endian word: input j) then 16 bytes of low nibbles (input
j low, j + 16 high), the unsigned codes q + 16 of int8 codes q in [-16, 15]; symmetric, groups of 32. That
is the layout the native CPU kernels read, so a Q5_0 matrix loads as one strided copy of its blocks; the
consumers that take int8 only get them widened (`widen_int5`).

fp8 weights are e4m3 with one float32 scale per output channel (`zeros` None, g = K), or, as
DeepSeek-V3 and Qwen3-FP8 checkpoints store them, one scale per 128x128 block: `block_rows` output
rows share a row of `scales` (`scales[n // block_rows, k // group_size]`). `block_rows` is 1 for
every other form.

GPTQ's act-order (`desc_act`) checkpoints assign input columns to groups out of order. Sorting the
columns by group makes the groups contiguous again; `in_perm` then records which input feature each
stored column multiplies, and the layer gathers `x[:, in_perm]` before the matmul (as vLLM and
exllama do), which keeps the file's values exact.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

KINDS = ("int8", "int4", "fp8")
INT5_RUN = 32  # int5 codes per run
INT5_RUN_BYTES = 20  # a run's bytes: 4 of fifth bits, 16 of low nibbles
FP8_DTYPE = torch.float8_e4m3fn  # fp8 weights and the fp8 KV cache
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448; e4m3fn has no inf, so a cast beyond it may give NaN
# Torch dtypes numpy can view without a copy (not bf16 or fp8), for the CPU copies done through numpy.
_NUMPY_DTYPES = frozenset({torch.uint8, torch.int8, torch.int32, torch.float16, torch.float32})


class Fp8Layout(NamedTuple):
    """How an fp8 (W8A8) linear takes its input: e4m3 codes with one float32 scale per row and
    `group_size` inputs; for cuBLAS's blockwise GEMM the scales column-major (stride (1, rows)) and the
    rows padded with zero rows to a multiple of `row_multiple`."""

    group_size: int
    column_major_scales: bool = False
    row_multiple: int = 1


class Fp8Activation(NamedTuple):
    """An activation quantized in the layout of the fp8 linear that reads it, by that linear or already
    by the norm or activation kernel that produced it (ember/kernels: rms_norm_fp8, silu_and_mul_fp8)."""

    codes: torch.Tensor  # e4m3 [rows rounded up to layout.row_multiple, K]; the padding rows are zeros
    scales: torch.Tensor  # float32 [padded rows, ceil(K / group_size)]
    rows: int
    dtype: torch.dtype  # the unquantized activation's, which the linear's output takes
    layout: Fp8Layout


@dataclass(frozen=True)
class ScaleFactors:
    """How a GGUF K-quant builds its group scales and zeros: `scales[n, g] == scale_base[n, g // per] *
    scale_codes[n, g]` in float32, bit for bit (a float16 super-block scale times a 6- or 8-bit sub-block
    code, the product llama.cpp's decoding computes), and `zeros` likewise. Optional beside the float32
    scales: kernels that read these read 1 byte a group instead of 4; operations that build a new weight
    (narrow, concat, to) drop them, which costs only that compaction."""

    per: int  # groups per super-block: 256 / group_size
    scale_base: torch.Tensor  # float32 [N, G / per], float16 values
    scale_codes: torch.Tensor  # int8 [N, G]
    zero_base: torch.Tensor | None  # likewise, or None
    zero_codes: torch.Tensor | None

    def to(self, device: torch.device | str) -> ScaleFactors:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        base, codes = self.scale_base.to(device), self.scale_codes.to(device)
        return ScaleFactors(self.per, base, codes, move(self.zero_base), move(self.zero_codes))


def _cat_factors(parts: list[QuantizedWeight]) -> ScaleFactors | None:
    """The parts' ScaleFactors stacked by rows, where every part has them alike; else None."""
    factors = [p.factors for p in parts]
    if any(f is None for f in factors) or len({(f.per, f.zero_base is None) for f in factors if f}) != 1:
        return None
    fs = [f for f in factors if f is not None]
    zeros = fs[0].zero_base is not None
    return ScaleFactors(
        fs[0].per,
        _cat_rows([f.scale_base for f in fs]),
        _cat_rows([f.scale_codes for f in fs]),
        _cat_rows([f.zero_base for f in fs if f.zero_base is not None]) if zeros else None,
        _cat_rows([f.zero_codes for f in fs if f.zero_codes is not None]) if zeros else None,
    )


@dataclass
class QuantizedWeight:
    kind: str  # "int8" (int8 storage), "int4" (two unsigned nibbles per byte), "int5" (runs of 32), "fp8"
    # int8 [N, K]; uint8 [N, ceil(K / 2)] for int4, [N, K / 32 * INT5_RUN_BYTES] for int5; float8_e4m3fn [N, K] for fp8
    qweight: torch.Tensor
    scales: torch.Tensor  # float32 [N, ceil(K / group_size)]
    zeros: torch.Tensor | None  # float32, shape of scales; None for symmetric formats
    group_size: int
    in_features: int  # K (int4 storage alone cannot tell an odd K from K + 1)
    block_rows: int = 1  # output rows sharing one row of scales (128 for block-scaled fp8)
    in_perm: torch.Tensor | None = None  # int64 [K]: stored column j multiplies input in_perm[j]; None: j
    factors: ScaleFactors | None = None  # GGUF K-quants' two-level scales (the same values as `scales`)
    # int4 only: the codes in runs of 32 inputs (byte j of a run: input j low, j + 16 high nibble) with float16
    # scales and zeros, as GGUF Q4_1 blocks store them and the native CPU kernels read them (see `packed`)
    runs: bool = False

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """A copy of rows (dim 0) or of whole groups of columns (dim 1): a tensor-parallel rank's
        slice. Columns must start on a group boundary (and, for int4, on a byte) so the slice keeps
        its own scales; the file's block size decides which splits are possible."""
        if dim == 0:
            if start % self.block_rows or (length % self.block_rows and start + length != self.out_features):
                raise ValueError(
                    f"cannot split a weight with scale blocks of {self.block_rows} rows at rows "
                    f"{start}:{start + length}; choose a tensor_parallel_size that splits on block boundaries"
                )
            rows = slice(start // self.block_rows, -(-(start + length) // self.block_rows))
            return QuantizedWeight(
                self.kind,
                self.qweight[start : start + length].clone(),
                self.scales[rows].clone(),
                None if self.zeros is None else self.zeros[rows].clone(),
                self.group_size,
                self.in_features,
                self.block_rows,
                self.in_perm,
                runs=self.runs,
            )
        if self.in_perm is not None:
            raise ValueError(
                "cannot split an act-order (GPTQ desc_act) weight by input columns: its groups "
                "are spread over all of them; use tensor_parallel_size 1 or a checkpoint without desc_act"
            )
        end = start + length
        if start % self.group_size or (end % self.group_size and end != self.in_features):
            raise ValueError(
                f"cannot split a {self.kind} weight with groups of {self.group_size} inputs at "
                f"columns {start}:{end}; choose a tensor_parallel_size that splits on group boundaries"
            )
        if self.kind == "int4" and start % 2:
            raise ValueError(f"cannot split packed int4 codes at the odd column {start}")
        cols = slice(code_bytes(self.kind, start), code_bytes(self.kind, end))
        groups = slice(start // self.group_size, -(-end // self.group_size))
        return QuantizedWeight(
            self.kind,
            self.qweight[:, cols].contiguous(),
            self.scales[:, groups].contiguous(),
            None if self.zeros is None else self.zeros[:, groups].contiguous(),
            self.group_size,
            length,
            self.block_rows,
            runs=self.runs,
        )

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight, self.scales, self.zeros, self.in_perm) if t is not None]

    def nbytes(self) -> int:
        """Bytes held in memory: codes, scales and zeros."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(
            self.kind,
            self.qweight.to(device),
            self.scales.to(device),
            None if self.zeros is None else self.zeros.to(device),
            self.group_size,
            self.in_features,
            self.block_rows,
            None if self.in_perm is None else self.in_perm.to(device),
            None if self.factors is None else self.factors.to(device),
            self.runs,
        )


def code_bytes(kind: str, inputs: int) -> int:
    """The stored columns (bytes, but for fp8) that the codes of a row's first `inputs` inputs take; for
    int5, `inputs` is whole runs."""
    if kind == "int4":
        return -(-inputs // 2)
    return inputs // INT5_RUN * INT5_RUN_BYTES if kind == "int5" else inputs


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values in 0..15 -> uint8 [N, ceil(K / 2)], element 2j in the low nibble of byte j.

    On CPU through numpy, several times faster than torch's strided uint8 ops (model load time)."""
    if q.shape[1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    q = q.to(torch.uint8)
    if q.device.type == "cpu":
        a = q.numpy()
        return torch.from_numpy(a[:, 0::2] | (a[:, 1::2] << 4))
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Inverse of pack_int4: uint8 [N, K] values in 0..15.

    On CPU through numpy, writing both nibbles into one array: 9x faster than torch.stack of the two
    (3 ms against 30 ms of CPU time for 4M bytes), which showed as 1.9 s of the default model's load."""
    if packed.device.type == "cpu":
        a = packed.numpy()
        out = np.empty((*a.shape, 2), dtype=np.uint8)
        np.bitwise_and(a, 0x0F, out=out[..., 0])
        np.right_shift(a, 4, out=out[..., 1])
        return torch.from_numpy(out.reshape(a.shape[0], -1)[:, :in_features])
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)[:, :in_features]


def int5_values(runs: np.ndarray) -> np.ndarray:
    """uint8 int5 runs [n, INT5_RUN_BYTES] -> their unsigned codes, uint8 [n, INT5_RUN] in 0..31."""
    nibbles = runs[:, 4:INT5_RUN_BYTES]
    low = np.stack([nibbles & 0x0F, nibbles >> 4], axis=-2).reshape(len(runs), INT5_RUN)
    return low | (np.unpackbits(runs[:, :4], axis=-1, bitorder="little") << 4)


def widen_int5(w: QuantizedWeight) -> QuantizedWeight:
    """`w` with int5 codes as int8 ones (the same values; other kinds as they are), for the consumers that
    take int8: GPU kernels, PyTorch's CPU operators, stacked experts, a fused layer beside an int8 part.
    Unpacked on the host, once, at load."""
    if w.kind != "int5":
        return w
    runs = np.ascontiguousarray(w.qweight.cpu().numpy()).reshape(-1, INT5_RUN_BYTES)
    q = (int5_values(runs).view(np.int8) - np.int8(16)).reshape(w.out_features, w.in_features)
    return replace(w, kind="int8", qweight=torch.from_numpy(q).to(w.qweight.device))


def _run_nibbles(w: QuantizedWeight) -> torch.Tensor:
    """A `runs` weight's codes, uint8 [N, K / 32, 32] in input order."""
    q = w.qweight.reshape(w.out_features, -1, 16)
    return torch.cat([q & 0x0F, q >> 4], dim=-1)


def packed(w: QuantizedWeight) -> QuantizedWeight:
    """`w` in Ember's int4 packing with float32 scales and zeros where it is a `runs` weight, for every
    consumer but the native CPU kernels (GPU kernels, PyTorch's CPU operators); torch ops, so on any device."""
    if not w.runs:
        return w
    q = _run_nibbles(w)
    return replace(
        w,
        qweight=(q[..., 0::2] | (q[..., 1::2] << 4)).reshape(w.out_features, -1),
        scales=w.scales.float(),
        zeros=None if w.zeros is None else w.zeros.float(),
        runs=False,
    )


def codes(w: QuantizedWeight) -> torch.Tensor:
    """The integer (or fp8) codes as an [N, K] tensor, unpacked."""
    if w.runs:
        return _run_nibbles(w).reshape(w.out_features, w.in_features)
    if w.kind == "int5":
        return widen_int5(w).qweight
    return unpack_int4(w.qweight, w.in_features) if w.kind == "int4" else w.qweight


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense [N, K] weight in the codes' column order: the reference every kernel is tested against.
    Where K is whole groups, each group's scale and zero are broadcast over its inputs rather than
    gathered per input: the same products in 3 ops instead of 9 (QuantEmbedding looks rows up through
    this at every step: ~60 us of a 1 ms CPU step's overhead, 2026-12-05)."""
    q = codes(w).float()
    n, k = q.shape
    scales, zeros = w.scales, w.zeros
    if w.block_rows > 1:
        rows = torch.arange(n, device=q.device) // w.block_rows
        scales, zeros = scales[rows], None if zeros is None else zeros[rows]
    if k % w.group_size == 0:
        dense = q.reshape(n, -1, w.group_size) * scales.unsqueeze(-1)
        if zeros is not None:
            dense = dense + zeros.unsqueeze(-1)
        return dense.view(n, k).to(dtype)
    inputs = torch.arange(k, device=q.device) // w.group_size
    dense = q * scales[:, inputs]
    if zeros is not None:
        dense = dense + zeros[:, inputs]
    return dense.to(dtype)


def dense_weight(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense [N, K] weight as the layer applies it to x: columns in input order (see in_perm)."""
    dense = dequantize(w, dtype)
    if w.in_perm is None:
        return dense
    return torch.empty_like(dense).index_copy_(1, w.in_perm, dense)


def same_format(parts: list[QuantizedWeight]) -> bool:
    """Whether the weights can be stacked into one: same codes, groups, K, symmetry and column order."""
    key = {
        (p.kind, p.group_size, p.in_features, p.zeros is None, p.block_rows, p.in_perm is None, p.runs) for p in parts
    }
    perms = [p.in_perm for p in parts if p.in_perm is not None]
    return (
        len(key) == 1
        and all(p.out_features % p.block_rows == 0 for p in parts[:-1])
        and all(torch.equal(perms[0], q) for q in perms[1:])
    )


def concat_out(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights along the output dimension (fused q/k/v or gate/up); groups run along K, so this is exact."""
    first = parts[0]
    if not same_format(parts):
        raise ValueError(
            "cannot fuse quantized weights of different formats: "
            + ", ".join(f"{p.kind}/g{p.group_size}/K{p.in_features}" for p in parts)
        )
    # same_format: every part has zeros or none has
    zeros = None if first.zeros is None else _cat_rows([p.zeros for p in parts if p.zeros is not None])
    return QuantizedWeight(
        first.kind,
        _cat_rows([p.qweight for p in parts]),
        _cat_rows([p.scales for p in parts]),
        zeros,
        first.group_size,
        first.in_features,
        first.block_rows,
        first.in_perm,
        _cat_factors(parts),
        first.runs,
    )


def _cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along dim 0; on CPU through numpy, which copied a SmolLM2 layer's q/k/v codes in 0.014 ms
    of CPU time where torch.cat's threaded copy took 21 ms on this project's shared 2-core VM (model load)."""
    if tensors[0].device.type == "cpu" and tensors[0].dtype in _NUMPY_DTYPES:
        return torch.from_numpy(np.concatenate([t.numpy() for t in tensors]))
    return torch.cat(tensors)


def shape_only(w: QuantizedWeight) -> QuantizedWeight:
    """`w` without its codes and scales, for a layer whose own layout of them replaced the file's: its
    format, shape and column order stay readable, and it holds no weight memory."""
    empty = torch.empty(w.out_features, 0)
    return QuantizedWeight(
        w.kind, empty.to(w.qweight.dtype), empty, None, w.group_size, w.in_features, w.block_rows, w.in_perm
    )
