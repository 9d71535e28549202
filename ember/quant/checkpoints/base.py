"""The interface every pre-quantized checkpoint format implements, and its config-reading helpers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ember.errors import ModelLoadError
from ember.quant.formats import QuantizedWeight


@dataclass(frozen=True)
class CheckpointFormat:
    """How one `quantization_config.quant_method` stores a linear layer: which of a module's
    tensors it owns (`claims`) and how they become one QuantizedWeight (`assemble`)."""

    method: str  # quant_method as config.json names it
    source: str  # config.json, for errors
    fp8: bool  # whether (some) weights are fp8: GPUs need fp8 tensor cores for them

    def claims(self, suffix: str, is_fp8: bool) -> bool:
        """Whether a tensor named `<module>.<suffix>` (stored as e4m3 when is_fp8) is part of a
        quantized module rather than an ordinary checkpoint tensor."""
        raise NotImplementedError

    def assemble(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        """The module's weight from its claimed tensors (KeyError: one is missing; ValueError: bad shape)."""
        raise NotImplementedError


def field(qcfg: dict[str, Any], name: str, source: str, supported: tuple[Any, ...], default: Any = None) -> Any:
    """quantization_config[name], lower-cased where a string; a ModelLoadError naming the field and
    the supported values when it is not one of them."""
    value = qcfg.get(name, default)
    if isinstance(value, str):
        value = value.lower()
    if value not in supported:
        raise ModelLoadError(
            source,
            f"quantization_config.{name} = {value!r} is not supported for "
            f"{qcfg.get('quant_method')!r} checkpoints (supported: "
            f"{', '.join(map(repr, supported))})",
        )
    return value


def group_size(qcfg: dict[str, Any], source: str, key: str = "group_size") -> int:
    """A positive group size, or -1 (one group per row)."""
    value = qcfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not (value > 0 or value == -1):
        raise ModelLoadError(source, f"quantization_config.{key} = {value!r}: expected a positive integer or -1")
    return value


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected}")


FormatReader = Callable[[dict[str, Any], str], CheckpointFormat]
