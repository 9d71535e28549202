"""AutoAWQ checkpoints, GEMM packing (`quant_method: awq`, `version: gemm`).

Per linear layer: `qweight` int32 [K, N / 8], `qzeros` int32 [K / g, N / 8] and `scales` fp16
[K / g, N]; w[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]. Each int32 word holds 8 output
columns' 4-bit codes, not in column order: nibble i (lowest first) holds column ORDER[i] of its 8,
an interleave that suits AWQ's GEMM kernel's dequantization. GEMV / Marlin packings lay codes out
differently and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ember.quant.checkpoints.base import (
    CheckpointFormat,
    check_shape,
    field,
    group_size,
)
from ember.quant.checkpoints.packing import affine_weight, unpack_int32
from ember.quant.formats import QuantizedWeight

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_TO_COLUMNS = tuple(ORDER.index(c) for c in range(8))  # the nibble holding each column: (0, 4, 1, 5, 2, 6, 3, 7)
_PARTS = ("qweight", "qzeros", "scales")


@dataclass(frozen=True)
class AWQFormat(CheckpointFormat):
    group_size: int = 128

    def claims(self, suffix: str, is_fp8: bool) -> bool:
        return suffix in _PARTS

    def assemble(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        qweight, qzeros, scales = (parts[p] for p in _PARTS)
        q = unpack_columns(qweight)
        k, n = q.shape
        g = k if self.group_size == -1 else self.group_size
        groups = -(-k // g)
        check_shape("scales", scales, (groups, n))
        check_shape("qzeros", qzeros, (groups, n // 8))
        return affine_weight(q.t(), unpack_columns(qzeros).t(), scales.t(), 4, g)


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ's interleaved nibble order -> codes [R, C] in column order."""
    codes = unpack_int32(packed, 4, dim=1)
    return codes.view(codes.shape[0], -1, 8)[:, :, list(_TO_COLUMNS)].reshape(codes.shape[0], -1)


def read(qcfg: dict[str, Any], source: str) -> AWQFormat:
    field(qcfg, "bits", source, (4,))
    field(qcfg, "version", source, ("gemm",), "gemm")
    field(qcfg, "zero_point", source, (True,), True)
    return AWQFormat("awq", source, fp8=False, group_size=group_size(qcfg, source))
