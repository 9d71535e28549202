"""Load llama.cpp GGUF checkpoints: config, tokenizer and weights.

A GGUF file carries everything an HF checkpoint spreads over config.json, tokenizer.json and
safetensors, but under llama.cpp's names and layouts. This module translates all three into the
HF shapes the rest of Ember already understands, so the model code never sees GGUF specifics.
Weights are decoded on the CPU with numpy, either to float32 or, for the block-quantized types,
losslessly into Ember's QuantizedWeight form so they can stay quantized.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
import tokenizers
import torch
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from ember.model.errors import ModelLoadError
from ember.model.gguf_blocks import QUANTIZED_TYPES, SUPPORTED_TYPES, dequantize, quantized
from ember.model.gguf_reader import GGUFFile, GGUFFormatError, GGUFTensor
from ember.quant.formats import QuantizedWeight

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# Tokens llama.cpp marks as CONTROL or USER_DEFINED must be matched whole, never split by BPE.
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Same as llama3 except digits are split one by one.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

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


_Rows = TypeVar("_Rows", np.ndarray, torch.Tensor)


def _unpermute(w: _Rows, n_head: int) -> _Rows:
    """Undo llama.cpp's interleaving of rotary halves within each head of q_proj/k_proj rows.

    llama.cpp rotates adjacent pairs (GPT-J style) while HF rotates the two halves of a head, so
    its converter reorders rows; the reshape below is that reordering run backwards.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_weight(w: np.ndarray | QuantizedWeight, n_head: int) -> np.ndarray | QuantizedWeight:
    """_unpermute for either weight form; rows are output channels, so a quantized weight's codes,
    scales and zeros all move together."""
    if isinstance(w, np.ndarray):
        return _unpermute(w, n_head)
    return replace(
        w,
        qweight=_unpermute(w.qweight, n_head),
        scales=_unpermute(w.scales, n_head),
        zeros=None if w.zeros is None else _unpermute(w.zeros, n_head),
    )


@dataclass
class GGUFModel:
    """A GGUF checkpoint translated to HF terms; weights are decoded lazily by tensors()."""

    path: str
    hf_config: dict
    tokenizer: tokenizers.Tokenizer
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int]
    add_bos_token: bool
    chat_template: str | None
    _reader: GGUFFile = field(repr=False)

    def tensors(self, keep_quantized: bool = False) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
        """Yield (HF name, weight) one tensor at a time, so peak memory stays near one tensor
        beyond the memory-mapped file.

        Weights are float32 arrays, except that with keep_quantized every 2-D block-quantized
        tensor comes as the QuantizedWeight that dequantizes to exactly that array.
        """
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
            shape = _numpy_shape(tensor)
            if keep_quantized and tensor.tensor_type in QUANTIZED_TYPES and len(shape) == 2:
                weight = quantized(tensor.data, tensor.tensor_type, shape)
            else:
                weight = dequantize(tensor.data, tensor.tensor_type, shape)
            match = _LAYER_TENSOR_RE.fullmatch(tensor.name)
            if match is not None and match[2] in permuted_heads:
                weight = _unpermute_weight(weight, permuted_heads[match[2]])
            yield hf_name, weight


def _numpy_shape(tensor: GGUFTensor) -> tuple[int, ...]:
    """GGML lists dimensions innermost first; numpy wants them outermost first.

    Leading 1s are dropped because a writer may pad a vector to 2-D, which HF never does.
    """
    shape = tuple(reversed(tensor.shape))
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


class _Metadata:
    """Access to GGUF key/value fields, raising ModelLoadError that names the file."""

    def __init__(self, path: str, reader: GGUFFile) -> None:
        self.path = path
        self.fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(self.path, f"GGUF metadata lacks {key!r}")
        return value


def load_gguf(path: str) -> GGUFModel:
    """Open a GGUF file and translate its metadata; weights stay memory-mapped until tensors()."""
    path = str(path)
    if not os.path.exists(path):
        raise ModelLoadError(path, "file not found")
    try:
        reader = GGUFFile(path)
    except (GGUFFormatError, OSError) as exc:
        raise ModelLoadError(path, f"not a valid GGUF file ({type(exc).__name__}: {exc})") from exc
    meta = _Metadata(path, reader)

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
            raise ModelLoadError(path, f"unexpected tensor {tensor.name!r} for architecture {arch!r}")
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(
                path, f"tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}"
            )

    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [
        token_id
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (token_id := meta.get(f"tokenizer.ggml.{key}")) is not None
    ]
    tokenizer_model = meta.require("tokenizer.ggml.model")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", tokenizer_model == "llama"))
    bos_token = tokens[bos_id] if bos_id is not None else None

    return GGUFModel(
        path=path,
        hf_config=_hf_config(meta, arch, names, len(tokens), bos_id, eos_id),
        tokenizer=_tokenizer(meta, tokenizer_model, tokens, bos_id if add_bos else None),
        bos_token=bos_token,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        eos_token_ids=list(dict.fromkeys(eos_ids)),
        add_bos_token=add_bos,
        chat_template=meta.get("tokenizer.chat_template"),
        _reader=reader,
    )


def _hf_config(
    meta: _Metadata, arch: str, tensor_names: set[str], n_tokens: int,
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


def _rope_scaling(meta: _Metadata, arch: str) -> dict | None:
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


def _tokenizer(
    meta: _Metadata, model: str, tokens: list[str], bos_id: int | None
) -> tokenizers.Tokenizer:
    """Rebuild the HF tokenizer llama.cpp derived its vocabulary from.

    `bos_id` is the token to prepend to every encoding, or None when the model wants none.
    """
    if model == "gpt2":
        tokenizer = _byte_level_bpe(meta, tokens)
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens)
    else:
        raise ModelLoadError(meta.path, f"unsupported tokenizer model {model!r} (supported: gpt2, llama)")

    token_types = meta.get("tokenizer.ggml.token_type", [])
    tokenizer.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind in (_CONTROL, _USER_DEFINED)
    ])
    if bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tokenizer


def _vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id, keeping the first id when a file repeats a token string."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    return vocab


def _bpe(meta: _Metadata, vocab: dict[str, int], merges: list, **options: Any) -> BPE:
    """A BPE model, reporting a merge that names a missing token as a broken file, not a crash."""
    try:
        return BPE(vocab, merges, **options)
    except Exception as exc:  # tokenizers raises a bare Exception
        raise ModelLoadError(meta.path, f"invalid tokenizer vocabulary ({exc})") from exc


def _byte_level_bpe(meta: _Metadata, tokens: list[str]) -> tokenizers.Tokenizer:
    merges = [tuple(merge.split(" ", 1)) for merge in meta.require("tokenizer.ggml.merges")]
    pre = meta.get("tokenizer.ggml.pre")
    # llama.cpp looks a whole pre-token up in the vocabulary before merging for llama3 only.
    llama3 = pre in ("llama-bpe", "llama3")
    tokenizer = tokenizers.Tokenizer(_bpe(meta, _vocab(tokens), merges, ignore_merges=llama3))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif llama3 or pre == "qwen2":
        split = _LLAMA3_SPLIT if llama3 else _QWEN2_SPLIT
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level,
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: _Metadata, tokens: list[str]) -> tokenizers.Tokenizer:
    """SentencePiece stores scores, not merges; HF recovers BPE merges from them.

    Every token that splits into two vocabulary pieces yields that merge, ranked by the merged
    token's score, so higher-scoring tokens are formed first, as SentencePiece would.
    """
    vocab = _vocab(tokens)
    scores = meta.require("tokenizer.ggml.scores")
    candidates = [
        (-scores[index], vocab[token[:cut]], vocab[token[cut:]])
        for token, index in vocab.items()
        for cut in range(1, len(token))
        if token[:cut] in vocab and token[cut:] in vocab
    ]
    candidates.sort()
    merges = [(tokens[left], tokens[right]) for _, left, right in candidates]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else ("<unk>" if "<unk>" in vocab else None)
    tokenizer = tokenizers.Tokenizer(
        _bpe(meta, vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    space = "\u2581"
    tokenizer.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(space)] if add_space_prefix else [])
        + [normalizers.Replace(" ", space)]
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    return tokenizer
