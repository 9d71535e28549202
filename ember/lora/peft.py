"""PEFT LoRA adapter directories, read and checked without torch: adapter_config.json and the header of
adapter_model.safetensors (names, dtypes, shapes), never the tensors themselves.

The front end checks an adapter here before its request is sent (a ValueError naming the field or file),
and the core again before it loads one (ember/model/lora.py reads the tensors by the names found here).
What Ember maps: q/k/v/o_proj of attention and gate/up/down_proj of a dense MLP, each the `lora_A`
[r, in] and `lora_B` [out, r] of one projection, and the model's `embed_tokens` (`lora_embedding_A`
[r, vocab], `lora_embedding_B` [hidden, r]) and `lm_head` (`lora_A` [r, hidden], `lora_B` [vocab, r]),
known by layer -1. PEFT also saves a copy of the base's embedding and LM head beside their adapters
(`save_embedding_layers="auto"`, `...embed_tokens.base_layer.weight`): accepted when shaped as the
base's and not read, since they are the base's own weights (a replaced layer, `modules_to_save` or
`trainable_token_indices`, is refused; so is a vocabulary of another size, PEFT's added tokens).
DoRA, biases and per-module rank or alpha patterns are refused with what is not supported.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import msgspec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module names -> Ember's module (suffix inside a decoder layer) and the slice of it they fill:
# q/k/v share the fused qkv_proj, gate/up the fused gate_up_proj.
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
# the model's own modules, outside the decoder layers: layer -1 in PeftAdapter.modules
EMBED, HEAD = "embed_tokens", "lm_head"
_KEY = re.compile(r"^base_model\.model\.(?P<path>.+)\.(?P<kind>lora_(?:embedding_)?[AB])(?:\.weight)?$")
_LAYER = re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>\w+)$")
_OUTER = re.compile(r"^(?:(?:model\.)?(?P<embed>embed_tokens)|(?P<head>lm_head))$")
_VOCAB_AXIS = {(EMBED, "lora_A"): 1, (HEAD, "lora_B"): 0}  # the vocabulary's axis of a tensor
# PEFT's copy of the base layer under an embedding or LM-head adapter (save_embedding_layers)
_BASE_COPY = re.compile(r"^base_model\.model\.(?:model\.)?(?P<module>embed_tokens|lm_head)\.base_layer\.weight$")


class LoRAShapes(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What an adapter must fit, sent by the core in `EngineCoreReady`: the slots' rank, the decoder's layers
    and, per PEFT module name Ember can adapt in this model, its projection's [in_features, out_features]
    (embed_tokens: [vocab, hidden], lm_head: [hidden, vocab])."""

    max_loras: int
    max_lora_rank: int
    num_layers: int
    shapes: dict[str, list[int]]


@dataclass(frozen=True)
class PeftAdapter:
    """A checked adapter: where its tensors are and how to scale them."""

    path: str
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora: folded into B when loaded
    weights_file: str
    # (layer, PEFT module name) -> (lora_A tensor name, lora_B tensor name); layer -1: embed_tokens, lm_head
    modules: dict[tuple[int, str], tuple[str, str]]


def read_adapter(path: str, limits: LoRAShapes) -> PeftAdapter:
    """The adapter at `path`, checked against the model; a ValueError naming the path and what is wrong."""
    config_file, weights_file = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"lora_path {path!r}: no such directory")
    for file in (config_file, weights_file):
        if not os.path.isfile(file):
            raise ValueError(f"lora_path {path!r}: missing {os.path.basename(file)} (a PEFT LoRA adapter directory)")
    config = _read_json(config_file)
    rank, scale = _check_config(path, config, limits)
    header = _safetensors_header(weights_file)
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for name, info in header.items():
        if _base_copy(path, name, list(info.get("shape", [])), limits):
            continue
        layer, module, kind = _parse_key(path, name, limits)
        in_features, out_features = limits.shapes[module]
        expected = [rank, in_features] if kind == "lora_A" else [out_features, rank]
        shape = list(info.get("shape", []))
        axis = _VOCAB_AXIS.get((module, kind))
        if axis is not None and len(shape) == 2 and shape[axis] != expected[axis]:
            raise ValueError(
                f"lora_path {path!r}: tensor {name!r} has a vocabulary of {shape[axis]}, the base model's is "
                f"{expected[axis]} (added tokens are not supported)"
            )
        if shape != expected:
            raise ValueError(
                f"lora_path {path!r}: tensor {name!r} has shape {info.get('shape')}, expected {expected} "
                f"(rank {rank}; {module} is {in_features} -> {out_features} in this model)"
            )
        halves.setdefault((layer, module), {})[kind] = name
    if not halves:
        raise ValueError(f"lora_path {path!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    modules = {}
    for key, pair in halves.items():
        if set(pair) != {"lora_A", "lora_B"}:
            missing = sorted({"lora_A", "lora_B"} - set(pair))
            raise ValueError(f"lora_path {path!r}: layer {key[0]} {key[1]} has no {missing[0]} tensor")
        modules[key] = (pair["lora_A"], pair["lora_B"])
    return PeftAdapter(path, rank, scale, weights_file, modules)


def _read_json(file: str) -> dict[str, Any]:
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return value


def _check_config(path: str, config: dict[str, Any], limits: LoRAShapes) -> tuple[int, float]:
    """(rank, scale) of adapter_config.json, or a ValueError naming the field Ember cannot serve."""

    def refuse(field: str, why: str) -> ValueError:
        return ValueError(f"lora_path {path!r}: {CONFIG_FILE} {field}: {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", f"only LORA adapters are served, got {config.get('peft_type')!r}")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise refuse("r", f"expected a positive integer, got {rank!r}")
    if rank > limits.max_lora_rank:
        raise refuse("r", f"rank {rank} is larger than max_lora_rank ({limits.max_lora_rank}); raise --max-lora-rank")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise refuse("lora_alpha", f"expected a number, got {alpha!r}")
    if config.get("bias", "none") != "none":
        raise refuse("bias", f"only 'none' is supported, got {config.get('bias')!r}")
    if config.get("modules_to_save"):
        raise refuse(
            "modules_to_save",
            f"whole replaced modules are not supported (got {config['modules_to_save']!r}); "
            "only LoRA deltas are served, embed_tokens and lm_head included as target_modules",
        )
    for field in ("use_dora", "rank_pattern", "alpha_pattern", "layers_pattern", "trainable_token_indices"):
        if config.get(field):
            raise refuse(field, f"not supported yet (got {config[field]!r})")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for name in targets:
            _check_target(path, name, limits)
        if config.get("ensure_weight_tying") and {EMBED, HEAD} & set(targets):
            raise refuse("ensure_weight_tying", "an LM-head adapter tied to the embedding's is not supported yet")
    # fan_in_fan_out describes the base weight's layout (GPT-2's Conv1D); PEFT computes B(A x) the same way
    # either way, so it changes nothing here.
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return rank, float(scale)


def _check_target(path: str, module: str, limits: LoRAShapes) -> None:
    if module not in limits.shapes:
        known = [m for m in (*TARGETS, EMBED, HEAD) if m in limits.shapes]
        raise ValueError(f"lora_path {path!r}: target module {module!r} cannot be mapped onto this model ({known} can)")


def _parse_key(path: str, name: str, limits: LoRAShapes) -> tuple[int, str, str]:
    """(layer, PEFT module, "lora_A" or "lora_B") of a tensor name; layer -1 for embed_tokens and lm_head."""
    key = _KEY.match(name)
    if key is None:
        raise ValueError(f"lora_path {path!r}: tensor {name!r} is not a LoRA weight Ember knows")
    module_path, kind = key["path"], key["kind"]
    _check_target(path, module_path.rsplit(".", 1)[-1], limits)
    outer = _OUTER.match(module_path)
    if outer is not None:
        module = EMBED if outer["embed"] else HEAD
        if kind.startswith("lora_embedding_") != (module == EMBED):
            raise ValueError(f"lora_path {path!r}: tensor {name!r} is not a LoRA weight of {module}")
        return -1, module, kind.replace("embedding_", "")
    layer = _LAYER.match(module_path)
    if layer is None or kind not in ("lora_A", "lora_B"):
        raise ValueError(f"lora_path {path!r}: tensor {name!r} is not in a decoder layer's projection")
    index = int(layer["layer"])
    if index >= limits.num_layers:
        raise ValueError(f"lora_path {path!r}: tensor {name!r} is for layer {index}; the model has {limits.num_layers}")
    return index, layer["module"], kind


def _base_copy(path: str, name: str, shape: list[int], limits: LoRAShapes) -> bool:
    """Whether `name` is PEFT's copy of the base's embedding or LM head (skipped), checked to be the base's
    shape: [vocab, hidden] for both."""
    copy = _BASE_COPY.match(name)
    if copy is None:
        return False
    vocab, hidden = limits.shapes[EMBED] if EMBED in limits.shapes else (None, None)
    if shape != [vocab, hidden]:
        raise ValueError(
            f"lora_path {path!r}: tensor {name!r} has shape {shape}, the base model's {copy['module']} is "
            f"[{vocab}, {hidden}] (added tokens are not supported)"
        )
    return True


def _safetensors_header(file: str) -> dict[str, dict[str, Any]]:
    """The tensors' entries of a safetensors file: an 8-byte little-endian length, then that much JSON."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError(f"a {length}-byte header")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise ValueError(f"{file}: not a safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header
