"""GPTQ checkpoints as AutoGPTQ and GPTQModel write them (`quant_method: gptq`, 4 or 8 bits).

Per linear layer: `qweight` int32 [K * bits / 32, N] (32 / bits codes of consecutive input rows
per word, lowest bits first), `qzeros` int32 [G, N * bits / 32] (consecutive output columns per
word), `scales` fp16 [G, N] and `g_idx` int32 [K], each input column's group. w[n, k] =
(q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n].

The original (v1) format stores each zero point minus one (`checkpoint_format: gptq`, the
default), so a symmetric 4-bit file holds 7 for a zero of 8; `gptq_v2` stores zero points as they
are. With `desc_act` the groups are scattered over K; see packing.act_order. 2- and 3-bit files
(3 bits spans word boundaries) and kernel-specific repackings (marlin, ...) are refused.
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
from ember.quant.checkpoints.packing import act_order, affine_weight, unpack_int32
from ember.quant.formats import QuantizedWeight

_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class GPTQFormat(CheckpointFormat):
    bits: int = 4
    group_size: int = 128
    zero_offset: int = 1  # added to stored zero points: 1 for v1 files, 0 for gptq_v2

    def claims(self, suffix: str, is_fp8: bool) -> bool:
        return suffix in _PARTS

    def assemble(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        q = unpack_int32(qweight, self.bits, dim=0)
        k, n = q.shape
        g = k if self.group_size == -1 else self.group_size
        groups = -(-k // g)
        check_shape("scales", scales, (groups, n))
        check_shape("qzeros", qzeros, (groups, n * self.bits // 32))
        z = unpack_int32(qzeros, self.bits, dim=1) + self.zero_offset
        perm = act_order(parts.get("g_idx"), k, g)
        q = q.t() if perm is None else q.t()[:, perm]
        return affine_weight(q, z.t(), scales.t(), self.bits, g, perm)


def read(qcfg: dict[str, Any], source: str) -> GPTQFormat:
    bits = field(qcfg, "bits", source, (4, 8))
    key = "checkpoint_format" if "checkpoint_format" in qcfg else "format"
    version = field(qcfg, key, source, ("gptq", "gptq_v2"), "gptq")
    return GPTQFormat(
        "gptq",
        source,
        fp8=False,
        bits=bits,
        group_size=group_size(qcfg, source),
        zero_offset=1 if version == "gptq" else 0,
    )
