"""Pre-quantized Hugging Face checkpoints (AWQ, GPTQ, compressed-tensors, fp8; gpt-oss's MXFP4 experts)
read straight into Ember's QuantizedWeight, without re-quantizing: each format's dequantization maps exactly onto
Ember's affine form (see packing.py), so the model computes with the file's own weights.

config.json's `quantization_config.quant_method` picks the format; `quantized_weights` then turns
each quantized module's tensors (e.g. `q_proj.qweight`, `q_proj.qzeros`, `q_proj.scales`) into one
`q_proj.weight` QuantizedWeight, and passes every other tensor through as it is.

Each format's reader is imported with the first checkpoint that declares a quantization_config
(`_readers`): 5.5 ms of the engine core's imports that an unquantized checkpoint never needs (median of
3, 2-core EPYC, 2026-12-07).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ember.errors import ModelLoadError
from ember.quant.checkpoints.base import CheckpointFormat, FormatReader
from ember.quant.formats import FP8_DTYPE, QuantizedWeight

METHODS = ("awq", "gptq", "compressed-tensors", "fp8", "mxfp4")


def _readers() -> dict[str, FormatReader]:
    """Each method's reader, keyed as METHODS lists them."""
    from ember.quant.checkpoints import awq, compressed_tensors, fp8, gptq, mxfp4

    return {
        "awq": awq.read,
        "gptq": gptq.read,
        "compressed-tensors": compressed_tensors.read,
        "fp8": fp8.read,
        "mxfp4": mxfp4.read,
    }


def checkpoint_format(cfg: dict[str, Any], source: str) -> CheckpointFormat | None:
    """The format config.json's quantization_config declares; None when it declares none."""
    qcfg = cfg.get("quantization_config")
    if qcfg is None:
        return None
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    method = method.lower() if isinstance(method, str) else method
    if method not in METHODS:
        raise ModelLoadError(
            source, f"quantization_config.quant_method = {method!r} is not supported (supported: {', '.join(METHODS)})"
        )
    return _readers()[method](qcfg, source)


def quantized_weights(
    weights: Iterator[tuple[str, Any]], fmt: CheckpointFormat, source: str
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each quantized module's parts replaced by one QuantizedWeight.

    Parts are read as they come and assembled once every file has been read (a module's tensors
    may sit in different shards); they are small beside the float model they replace."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, suffix = name.rpartition(".")
        if fmt.claims(suffix, _is_fp8(tensor)):
            modules.setdefault(module, {})[suffix] = _read(tensor)
        else:
            yield name, tensor
    for module in list(modules):
        parts = modules.pop(module)
        yield f"{module}.weight", _assemble(fmt, module, parts, source)


def _assemble(fmt: CheckpointFormat, module: str, parts: dict[str, torch.Tensor], source: str) -> QuantizedWeight:
    try:
        return fmt.assemble(module, parts)
    except KeyError as e:
        raise ModelLoadError(
            source,
            f"{fmt.method} module {module!r} has no tensor {module}.{e.args[0]} (found: {', '.join(sorted(parts))})",
        ) from e
    except ValueError as e:
        raise ModelLoadError(source, f"{fmt.method} module {module!r}: {e}") from e


def _is_fp8(tensor: Any) -> bool:
    """torch tensors, and safetensors tensors not read yet (their dtype is safetensors' name)."""
    return getattr(tensor, "dtype", None) in (FP8_DTYPE, "F8_E4M3")


def _read(tensor: Any) -> torch.Tensor:
    load = getattr(tensor, "load", None)
    return tensor if load is None else load()
