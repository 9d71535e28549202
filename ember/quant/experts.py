"""Mixture-of-experts weights of one projection, stacked over experts in one quantized form.

The fused MoE kernels read expert e's codes and scales at a fixed stride from one tensor each, so
every expert of a projection must share kind, group size and K (GGUF `ffn_*_exps` tensors and
load-time quantization both give that). Each expert is exactly a `QuantizedWeight`; this type only
adds the leading expert dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.quant.formats import QuantizedWeight, dequantize, same_format
from ember.quant.quantize import quantize


@dataclass
class QuantizedExperts:
    kind: str  # as QuantizedWeight.kind
    qweight: torch.Tensor  # [E, N, K] int8 / fp8; uint8 [E, N, ceil(K / 2)] for int4
    scales: torch.Tensor  # float32 [E, N, ceil(K / group_size)]
    zeros: torch.Tensor | None  # float32, shape of scales; None for symmetric formats
    group_size: int
    in_features: int

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def expert(self, e: int) -> QuantizedWeight:
        """Expert e's weight as a view (no copy)."""
        return QuantizedWeight(
            self.kind,
            self.qweight[e],
            self.scales[e],
            None if self.zeros is None else self.zeros[e],
            self.group_size,
            self.in_features,
        )

    def narrow(self, dim: int, start: int, length: int) -> QuantizedExperts:
        """Every expert's rows (dim 0) or columns (dim 1) start:start+length, with QuantizedWeight.narrow's
        rules: a tensor-parallel rank's slice of the intermediate dimension."""
        return stack_experts([self.expert(e).narrow(dim, start, length) for e in range(self.num_experts)])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros) if t is not None)

    def to(self, device: torch.device | str) -> QuantizedExperts:
        return QuantizedExperts(
            self.kind,
            self.qweight.to(device),
            self.scales.to(device),
            None if self.zeros is None else self.zeros.to(device),
            self.group_size,
            self.in_features,
        )


def stack_experts(weights: list[QuantizedWeight]) -> QuantizedExperts:
    if not same_format(weights) or len({w.out_features for w in weights}) != 1 or weights[0].block_rows != 1:
        raise ValueError(
            "experts of one projection must share one quantized format and shape: "
            + ", ".join(sorted({f"{w.kind}/g{w.group_size}/{w.out_features}x{w.in_features}" for w in weights}))
        )
    first = weights[0]
    # one format (checked above): every expert has zeros or none has
    zeros = None if first.zeros is None else torch.stack([w.zeros for w in weights if w.zeros is not None])
    return QuantizedExperts(
        first.kind,
        torch.stack([w.qweight for w in weights]),
        torch.stack([w.scales for w in weights]),
        zeros,
        first.group_size,
        first.in_features,
    )


def quantize_experts(w: torch.Tensor, method: str) -> QuantizedExperts:
    """[E, N, K] dense experts -> the load-time quantized form of `method` (`--quantization`). The
    stacked form has one row of scales per output row, so fp8 experts take per-channel scales."""
    method = "ptpc_fp8" if method == "fp8" else method
    return stack_experts([quantize(w[e], method) for e in range(w.shape[0])])


def dequantize_experts(w: QuantizedExperts, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense [E, N, K]: the reference the fused kernels are tested against."""
    return torch.stack([dequantize(w.expert(e), dtype) for e in range(w.num_experts)])
