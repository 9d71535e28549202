"""Load llama.cpp GGUF checkpoints: config, tokenizer and weights.

A GGUF file carries everything an HF checkpoint spreads over config.json, tokenizer.json and
safetensors, but under llama.cpp's names and layouts. This module translates all three into the
HF shapes the rest of Ember already understands, so the model code never sees GGUF specifics.
Weights are decoded on the CPU with numpy, either to float32 or, for the block-quantized types,
losslessly into Ember's QuantizedWeight form so they can stay quantized (gguf_blocks says which
type takes which form).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import tokenizers

from ember.model.errors import ModelLoadError
from ember.model.gguf_blocks import (
    FLOAT_TYPES,
    QUANTIZED_TYPES,
    SUPPORTED_TYPES,
    dequantize,
    quantized,
    quantized_form,
    supported_names,
)
from ember.model.gguf_reader import GGUFFile, GGUFTensor
from ember.model.gguf_tokenizer import GGUFMetadata, GGUFVocab, open_gguf
from ember.quant.formats import QuantizedWeight

logger = logging.getLogger("ember")

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's llama3 rope scaling, precomputed per frequency; HF derives it from config instead.
_ROPE_FREQS = "rope_freqs.weight"

def _hf_tensor_name(name: str) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = _LAYER_TENSOR_RE.fullmatch(name)
    if match is None or match[2] not in _LAYER_TENSORS:
        return None
    return f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.{match[3]}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary halves within each head of q_proj/k_proj rows.

    llama.cpp rotates adjacent pairs (GPT-J style) while HF rotates the two halves of a head, so
    its converter reorders rows; the reshape below is that reordering run backwards.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class GGUFModel:
    """A GGUF checkpoint translated to HF terms; weights are decoded lazily by tensors(), and the
    tokenizer is built only when asked for (the engine core never needs it)."""

    path: str
    hf_config: dict
    vocab: GGUFVocab = field(repr=False)
    _reader: GGUFFile = field(repr=False)

    @functools.cached_property
    def tokenizer(self) -> tokenizers.Tokenizer:
        return self.vocab.build()

    @property
    def add_bos_token(self) -> bool:
        return self.vocab.add_bos_token

    def tensors(self, keep_quantized: bool = False) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
        """Yield (HF name, weight) one tensor at a time, so peak memory stays near one tensor
        beyond the memory-mapped file.

        Weights are float32 arrays, except that with keep_quantized every 2-D block-quantized
        tensor comes as the QuantizedWeight that dequantizes to exactly that array.
        """
        logger.info("%s: %s", os.path.basename(self.path), self._type_summary(keep_quantized))
        permuted_heads = {}
        if self.hf_config["model_type"] == "llama":
            permuted_heads = {
                "attn_q": self.hf_config["num_attention_heads"],
                "attn_k": self.hf_config["num_key_value_heads"],
            }
        for tensor in self._reader.tensors:
            if tensor.name == _ROPE_FREQS:
                continue
            hf_name = _hf_tensor_name(tensor.name)
            assert hf_name is not None, "load_gguf validated every tensor name"
            shape, data = _numpy_shape(tensor), tensor.data
            self._reader.populate(tensor)
            match = _LAYER_TENSOR_RE.fullmatch(tensor.name)
            n_head = permuted_heads.get(match[2]) if match is not None else None
            if n_head is not None and len(shape) == 2:
                # Rows are output channels, whole blocks each: reorder the stored rows once rather
                # than the decoded codes, scales and zeros (torch's strided uint8 copy of the codes
                # cost 1.8 s of the default model's 2.2 s load on a busy machine).
                data, n_head = _unpermute(data.reshape(shape[0], -1), n_head), None
            if keep_quantized and _keeps_quantized(tensor):
                weight = quantized(data, tensor.tensor_type, shape)
            else:
                weight = dequantize(data, tensor.tensor_type, shape)
            yield hf_name, weight if n_head is None else _unpermute(weight, n_head)

    def _type_summary(self, keep_quantized: bool) -> str:
        """One line: each tensor type with its count and what it becomes, e.g.
        "F32 x 49 -> float, IQ3_S x 24 -> int8 g32 (kept), Q4_K x 120 -> int4 g32 (kept)"."""
        forms = Counter((t.tensor_type.name, _form(t, keep_quantized))
                        for t in self._reader.tensors if t.name != _ROPE_FREQS)
        return ", ".join(f"{name} x {count} -> {form}" for (name, form), count in sorted(forms.items()))


def _form(tensor: GGUFTensor, keep_quantized: bool) -> str:
    if keep_quantized and _keeps_quantized(tensor):
        return f"{quantized_form(tensor.tensor_type)} (kept)"
    return "float" if tensor.tensor_type in FLOAT_TYPES else "decoded to float"


def _known_tensor_names() -> str:
    layer = (f"blk.N.{name}.weight" for name in _LAYER_TENSORS)
    return ", ".join([*_GLOBAL_TENSORS, _ROPE_FREQS, *layer]) + " (and .bias of blk.N tensors)"


def _keeps_quantized(tensor: GGUFTensor) -> bool:
    """Matrices of a type with an exact QuantizedWeight form stay quantized (vectors are small)."""
    return tensor.tensor_type in QUANTIZED_TYPES and len(_numpy_shape(tensor)) == 2


def _numpy_shape(tensor: GGUFTensor) -> tuple[int, ...]:
    """GGML lists dimensions innermost first; numpy wants them outermost first.

    Leading 1s are dropped because a writer may pad a vector to 2-D, which HF never does.
    """
    shape = tuple(reversed(tensor.shape))
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def load_gguf(path: str) -> GGUFModel:
    """Open a GGUF file and translate its metadata; weights stay memory-mapped until tensors()."""
    path = str(path)
    if not os.path.exists(path):
        raise ModelLoadError(path, "file not found")
    meta = open_gguf(path)
    reader = meta.reader

    arch = meta.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            path, f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})"
        )
    names = {tensor.name for tensor in reader.tensors}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        if _hf_tensor_name(tensor.name) is None:
            raise ModelLoadError(path, f"unexpected tensor {tensor.name!r} for architecture {arch!r} "
                                       f"(supported: {_known_tensor_names()})")
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(path, f"tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name} "
                                       f"(supported: {supported_names()})")

    vocab = GGUFVocab.read(meta)
    return GGUFModel(path=path, hf_config=_hf_config(meta, arch, names, len(vocab.tokens), vocab.bos_id, vocab.eos_id),
                     vocab=vocab, _reader=reader)


def _hf_config(
    meta: GGUFMetadata, arch: str, tensor_names: set[str], n_tokens: int,
    bos_id: int | None, eos_id: int | None,
) -> dict:
    hidden = meta.require(f"{arch}.embedding_length")
    heads = meta.require(f"{arch}.attention.head_count")
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": meta.get(f"{arch}.vocab_size", n_tokens),
        "hidden_size": hidden,
        "intermediate_size": meta.require(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.require(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": meta.get(f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": meta.require(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch),
        "max_position_embeddings": meta.require(f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def _rope_scaling(meta: GGUFMetadata, arch: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None or kind == "none":
        return None
    factor = meta.require(f"{arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": meta.require(
                f"{arch}.rope.scaling.original_context_length"
            ),
        }
    raise ModelLoadError(meta.path, f"unsupported rope scaling type {kind!r}")
