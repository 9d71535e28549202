"""The matmul of one part of a quantized linear layer (ember.model.linear.QuantLinear): the
registry's unit for linear layers, whatever the device.

An implementation (here, and in linear_cpu, linear_native and linear_gpu) states which weights it
runs (`can_implement(target, w)`), lays the weight out once when built, and keeps its own row
crossovers. It has `weight` (what the layer keeps of the part: the weight, or only its shape where
the implementation's layout replaced the codes), `tensors()` (the memory its own layout adds) and
is called on x [M, K].
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ember.ops.target import Target
from ember.quant.formats import QuantizedWeight, dequantize


class LinearImpl(Protocol):
    @property
    def weight(self) -> QuantizedWeight | torch.Tensor: ...  # read-only here: each implementation's own is narrower

    def tensors(self) -> list[torch.Tensor]: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """A part that arrived dense (a GGUF file may store v_proj as F16 beside a Q4_K q_proj)."""

    permutes_input = False

    @staticmethod
    def can_implement(target: Target, w: QuantizedWeight | torch.Tensor) -> bool:
        return isinstance(w, torch.Tensor)

    def __init__(self, w: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight = w

    def tensors(self) -> list[torch.Tensor]:
        return []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class DequantizeLinear:
    """Any quantized weight on any device, dequantized to x's dtype on every call: the last resort,
    for weights no kernel covers."""

    permutes_input = True

    @staticmethod
    def can_implement(target: Target, w: QuantizedWeight | torch.Tensor) -> bool:
        return isinstance(w, QuantizedWeight)

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        self.weight = w

    def tensors(self) -> list[torch.Tensor]:
        return []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.weight, x.dtype))


class Permuted:
    """An act-order weight (GPTQ desc_act): its codes' columns are in act-order, so x's columns are put
    in that order before the implementation's matmul."""

    def __init__(self, impl: LinearImpl, perm: torch.Tensor) -> None:
        self.impl = impl
        self.perm = perm
        self.weight = impl.weight

    def tensors(self) -> list[torch.Tensor]:
        return self.impl.tensors()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl(x.index_select(1, self.perm))
