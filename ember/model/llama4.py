"""Llama 4 checkpoints (transformers' Llama4ForCausalLM, and the language model of
Llama4ForConditionalGeneration) in the names and layouts the decoder loads.

The decoder runs Llama 4 as config-driven details (ember.model.hf_config's `_llama4_config`): chunked
local attention on the rope layers, global NoPE layers with temperature-tuned queries, a weightless
QK norm, sigmoid top-k routing that scales the experts' input, and a shared expert. What is left to
the checkpoint's names and layouts is done here:

- `language_model.` (and transformers 5's `model.language_model.`) prefixes are dropped; the vision
  tower and projector (`vision_model.`, `multi_modal_projector.`) are skipped: text only.
- `feed_forward` is the decoder's `mlp`, its `router` the MoE block's `gate`.
- The experts come stacked as x @ W: `gate_up_proj` [E, H, 2I] (gate columns first, then up) and
  `down_proj` [E, I, H]; they become the stacked `mlp.experts.{gate,up,down}_proj.weight` ([E, N, K])
  that ember.model.moe loads for every MoE.
- Llama 4 rotates interleaved pairs (channels 2i, 2i + 1, as complex numbers: transformers'
  `apply_rotary_emb`); Ember's rotary pairs channel i with i + D/2. Each rope layer's q and k rows are
  reordered within every head (evens, then odds) so the one is the other: attention scores are dot
  products of q and k, the same under one permutation of both, and the weightless QK norm is too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ember.errors import ModelLoadError
from ember.model.hf_config import ModelConfig

_SKIPPED = ("vision_model.", "multi_modal_projector.", "model.vision_model.", "model.multi_modal_projector.")
_PREFIXES = {"language_model.": "", "model.language_model.": "model."}
_HF_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def checkpoint_tensors(weights: Iterable[tuple[str, Any]], cfg: ModelConfig, source: str) -> Iterator[tuple[str, Any]]:
    """The checkpoint's text-model tensors renamed and re-laid out (see the module docstring)."""
    for name, tensor in weights:
        if name.startswith(_SKIPPED):
            continue
        for prefix, replacement in _PREFIXES.items():
            if name.startswith(prefix):
                name = replacement + name[len(prefix) :]
                break
        name = name.replace(".feed_forward.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
        if name.endswith(_HF_EXPERTS):
            yield from _experts(name, _read(tensor), source)
        elif _rope_layer_qk(name, cfg):
            dense = _read(tensor)
            if not isinstance(dense, torch.Tensor):
                raise ModelLoadError(source, f"quantized tensor {name!r}: Llama 4's rope-layer q and k must be dense")
            yield name, interleaved_to_halves(dense, cfg.head_dim)
        else:
            yield name, tensor


def _experts(name: str, tensor: torch.Tensor, source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' [E, H, 2I] gate_up and [E, I, H] down as Ember's stacked [E, N, K] projections."""
    if tensor.dim() != 3:
        raise ModelLoadError(source, f"tensor {name!r} has shape {tuple(tensor.shape)}, expected 3-D stacked experts")
    w = tensor.transpose(1, 2)
    if name.endswith(".gate_up_proj"):
        gate, up = w.chunk(2, dim=1)
        yield name.removesuffix("gate_up_proj") + "gate_proj.weight", gate.contiguous()
        yield name.removesuffix("gate_up_proj") + "up_proj.weight", up.contiguous()
    else:
        yield name + ".weight", w.contiguous()


def _rope_layer_qk(name: str, cfg: ModelConfig) -> bool:
    """Whether `name` is a q or k projection (weight or bias) of a layer that applies rotary."""
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or parts[3] != "self_attn":
        return False
    return parts[4] in ("q_proj", "k_proj") and int(parts[2]) not in cfg.nope_layers


def interleaved_to_halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows (or a bias's entries) of whole heads reordered within each head: 0, 2, 4, .., 1, 3, 5, .."""
    heads = w.shape[0] // head_dim
    return w.reshape(heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _read(tensor: Any) -> Any:
    load = getattr(tensor, "load", None)
    return tensor if load is None else load()
