"""gpt-oss checkpoints (transformers' GptOssForCausalLM) in the names and layouts the decoder loads.

transformers keeps gpt-oss's experts as `mlp.experts.gate_up_proj` [E, H, 2I] (x @ W, gate and up
interleaved: columns 0::2 are gate, 1::2 up), `down_proj` [E, I, H], and biases `gate_up_proj_bias`
[E, 2I] (interleaved alike) and `down_proj_bias` [E, H]; the router is `mlp.router`. These become
the stacked `mlp.experts.{gate,up,down}_proj.{weight,bias}` ([E, N, K]) and `mlp.gate` that
ember.model.moe loads for every MoE.

OpenAI's released checkpoints (quantization_config.quant_method "mxfp4") store the experts' weights
as `*_blocks` (uint8 [E, N, K / 32, 16]: two e2m1 codes a byte, element 2j in the low nibble of byte
j) and `*_scales` (uint8 [E, N, K / 32]: e8m0 exponents, bias 127), rows already [out, in]. Each
block is re-laid out as llama.cpp's MXFP4 block (its exponent byte, then element j in the low and
j + 16 in the high nibble of byte j: the shuffle llama.cpp's converter does) and decoded by the GGUF
MXFP4 decoder into exact int8 codes with one scale per 32 (ember.model.gguf_codes), so the experts stay
quantized (1.125 bytes a weight instead of bf16's 2) and run through the fused MoE's int8 path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ember.errors import ModelLoadError
from ember.quant.experts import QuantizedExperts

ARCHITECTURE = "GptOssForCausalLM"
_EXPERTS = ".mlp.experts."
_MXFP4_BLOCK = 32
_HF_EXPERTS = ("gate_up_proj", "down_proj")  # and their _bias, _blocks, _scales


def checkpoint_tensors(weights: Iterable[tuple[str, Any]], source: str) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors renamed and re-laid out (see the module docstring); others pass through.
    An MXFP4 weight's blocks and scales may come in either order (or from different shards)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        kind = name.rpartition(".")[2]
        if name.endswith((".router.weight", ".router.bias")):
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
        elif _EXPERTS not in name or not kind.startswith(_HF_EXPERTS):  # other tensors, or Ember's names (GGUF)
            yield name, tensor
        elif kind.endswith(("_blocks", "_scales")):
            base, _, part = name.rpartition("_")
            parts = pending.setdefault(base, {})
            parts[part] = _read(tensor)
            if len(parts) == 2:
                del pending[base]
                yield from _experts(base, mxfp4_experts(parts["blocks"], parts["scales"], base), source)
        else:
            tensor = _read(tensor)
            yield from _experts(name, tensor if kind.endswith("_bias") else tensor.transpose(1, 2), source)
    for base, parts in pending.items():
        raise ModelLoadError(
            source,
            f"MXFP4 tensor {base}_{next(iter(parts))} has no {base}_{'scales' if 'blocks' in parts else 'blocks'}",
        )


def _experts(name: str, tensor: torch.Tensor | QuantizedExperts, source: str) -> Iterator[tuple[str, Any]]:
    """One transformers expert tensor ([E, N, K] weights, [E, N] biases) as Ember's stacked ones."""
    prefix, _, kind = name.rpartition(".")
    if kind in ("gate_up_proj", "gate_up_proj_bias"):
        suffix = "bias" if kind.endswith("_bias") else "weight"
        yield f"{prefix}.gate_proj.{suffix}", _rows(tensor, 0)
        yield f"{prefix}.up_proj.{suffix}", _rows(tensor, 1)
    elif kind in ("down_proj", "down_proj_bias"):
        yield f"{prefix}.down_proj.{'bias' if kind.endswith('_bias') else 'weight'}", tensor
    else:
        raise ModelLoadError(source, f"unexpected tensor {name!r} for {ARCHITECTURE}")


def _rows(tensor: torch.Tensor | QuantizedExperts, first: int) -> torch.Tensor | QuantizedExperts:
    """Every other output row (gate: from 0, up: from 1) of each expert."""
    if isinstance(tensor, QuantizedExperts):
        index = torch.arange(first, tensor.out_features, 2)
        zeros = None if tensor.zeros is None else tensor.zeros[:, index]
        return QuantizedExperts(
            tensor.kind, tensor.qweight[:, index], tensor.scales[:, index], zeros, tensor.group_size, tensor.in_features
        )
    return tensor[:, first::2].contiguous()


def _read(tensor: Any) -> torch.Tensor:
    load = getattr(tensor, "load", None)
    return tensor if load is None else load()


def mxfp4_experts(blocks: torch.Tensor, scales: torch.Tensor, name: str = "experts") -> QuantizedExperts:
    """transformers' MXFP4 blocks [E, N, G, 16] and scales [E, N, G] -> QuantizedExperts [E, N, 32 G]."""
    if (
        blocks.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or blocks.dim() != 4
        or blocks.shape[-1] != 16
        or tuple(blocks.shape[:-1]) != tuple(scales.shape)
    ):
        raise ValueError(
            f"{name}: MXFP4 blocks must be uint8 [E, N, G, 16] with scales uint8 [E, N, G], got "
            f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}"
        )
    # Here, not at the top: every model's decoder imports this module, and only gpt-oss's MXFP4 checkpoints
    # need the GGUF decoders (see ember.model.loader).
    from gguf import GGMLQuantizationType as QType

    from ember.model.gguf import quantized_tensor

    e, n, g, _ = blocks.shape
    packed = blocks.numpy()
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(e, n, g, _MXFP4_BLOCK)  # element order
    gguf_blocks = np.concatenate([scales.numpy()[..., None], codes[..., :16] | (codes[..., 16:] << 4)], axis=-1)
    experts = quantized_tensor(gguf_blocks, QType.MXFP4, (e, n, g * _MXFP4_BLOCK))
    assert isinstance(experts, QuantizedExperts)  # a 3-D shape gives stacked experts
    return experts
