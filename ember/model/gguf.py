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
import math
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ember.errors import ModelLoadError
from ember.model import gguf_qwen3next as qwen3next
from ember.model.gguf_blocks import (
    FLOAT_TYPES,
    QUANTIZED_TYPES,
    SUPPORTED_TYPES,
    dequantize,
    quantized,
    quantized_form,
    supported_names,
)
from ember.model.gguf_encoders import GLOBAL_TENSORS as ENCODER_GLOBAL_TENSORS
from ember.model.gguf_encoders import LAYER_PREFIXES as ENCODER_LAYER_PREFIXES
from ember.model.gguf_encoders import LAYER_TENSORS as ENCODER_LAYER_TENSORS
from ember.model.gguf_encoders import encoder_config
from ember.model.gguf_moe import DENSE_TENSORS, SPLIT_KV_B, deepseek2_config, join_kv_b, llama4_config
from ember.model.gguf_moe import LAYER_TENSORS as MOE_LAYER_TENSORS
from ember.model.gguf_moe import UNSUFFIXED as MOE_UNSUFFIXED
from ember.model.gguf_reader import GGUFFile, GGUFTensor
from ember.model.gguf_tokenizer import GGUFMetadata, GGUFVocab, open_gguf
from ember.quant.experts import QuantizedExperts
from ember.quant.formats import QuantizedWeight, packed, widen_int5

if TYPE_CHECKING:
    import tokenizers

logger = logging.getLogger("ember")

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    # Qwen2.5-VL's language model: Qwen2 with M-RoPE, which is plain rotary for text (the three position
    # streams equal); its sections (`rope.dimension_sections`) matter only with a projector (gguf_mmproj)
    "qwen2vl": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",  # its own tensors and transforms: ember/model/gguf_qwen3next.py
    "gpt-oss": "GptOssForCausalLM",
    "bert": "BertModel",  # embedding models (all-MiniLM, bge; nomic-embed-text): ember/model/gguf_encoders.py
    "nomic-bert": "NomicBertModel",
    "deepseek2": "DeepseekV2ForCausalLM",  # or V3, by its routing: ember/model/gguf_moe.py
    "llama4": "Llama4ForCausalLM",
}
_GEMMA = ("gemma2", "gemma3")

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
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's four norms per layer: llama.cpp's ffn_norm is the one before the MLP in both layouts.
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Where an architecture's tensor differs from the table above: Phi-3's ffn_up holds gate and up stacked;
# gpt-oss's norm before the MLP is post_attention_norm, and its attention sinks are one vector per layer.
_ARCH_LAYER_TENSORS = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
    qwen3next.ARCH: qwen3next.LAYER_TENSORS,
}
_UNSUFFIXED = {"self_attn.sinks", *qwen3next.UNSUFFIXED, *MOE_UNSUFFIXED}  # HF names without .weight
# tensors that never stay quantized: an architecture reorders or regroups their rows at load
_DENSE = {**DENSE_TENSORS, qwen3next.ARCH: ("attn_qkv", "attn_gate")}
# Embedding tables keep their rows even when there is one (a BERT model with a single token type).
_TABLES = {"token_types.weight"}
# Files with `{arch}.expert_count` (qwen3moe; llama: Mixtral): the router and each projection stacked over
# experts (3-D, ember/model/moe.py).
_MOE_LAYER_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# llama.cpp names a tensor that has no HF suffix without one (qwen3next's ssm_a, from A_log)
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)(?:\.(weight|bias))?")
# llama.cpp's llama3 rope scaling, precomputed per frequency; HF derives it from config instead.
_ROPE_FREQS = "rope_freqs.weight"
# Phi-3's LongRoPE factors (HF keeps them in config.json's rope_scaling): read into the config.
_ROPE_FACTORS = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}
_CONFIG_TENSORS = {_ROPE_FREQS, *_ROPE_FACTORS.values()}


@functools.cache
def _layer_tensors(arch: str, experts: bool = False) -> dict[str, str]:
    """llama.cpp's per-layer tensor names -> HF's, for one architecture (with experts or without)."""
    if arch in ENCODER_LAYER_TENSORS:
        return ENCODER_LAYER_TENSORS[arch]
    if arch in MOE_LAYER_TENSORS:
        return MOE_LAYER_TENSORS[arch]
    return {
        **(_GEMMA_LAYER_TENSORS if arch in _GEMMA else _LAYER_TENSORS),
        **_ARCH_LAYER_TENSORS.get(arch, {}),
        **(_MOE_LAYER_TENSORS if experts else {}),
    }


def _global_tensors(arch: str) -> dict[str, str]:
    return ENCODER_GLOBAL_TENSORS.get(arch, _GLOBAL_TENSORS)


def _hf_tensor_name(name: str, arch: str, experts: bool) -> str | None:
    global_tensors = _global_tensors(arch)
    if name in global_tensors:
        return global_tensors[name]
    layer_tensors = _layer_tensors(arch, experts)
    match = _LAYER_TENSOR_RE.fullmatch(name)
    if match is None or match[2] not in layer_tensors:
        return None
    hf = layer_tensors[match[2]]
    if match[3] is None and hf not in _UNSUFFIXED:
        return None
    layers = ENCODER_LAYER_PREFIXES.get(arch, "model.layers")
    return f"{layers}.{match[1]}.{hf}" + ("" if hf in _UNSUFFIXED else f".{match[3]}")


def unshift_norm(w: np.ndarray) -> np.ndarray:
    """llama.cpp's Gemma converters store a norm's effective weight 1 + w; Ember's GemmaRMSNorm takes
    transformers' w. (1 + w) - 1 is exact in float32 whenever 1 + w >= 0.5 (Sterbenz), so the model's
    1 + w is then bit for bit the file's value; below 0.5 it may differ by one float32 ulp of 1."""
    return w - np.float32(1.0)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary halves within each head of q_proj/k_proj rows.

    llama.cpp rotates adjacent pairs (GPT-J style) while HF rotates the two halves of a head, so
    its converter reorders rows; the reshape below is that reordering run backwards.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class GGUFModel:
    """A GGUF checkpoint translated to HF terms, from one parse of the file; weights are decoded lazily
    by tensors(), and the tokenizer is built only when asked for (the engine core builds it from
    `vocab` for its first structured-output request only)."""

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

    def tensors(
        self, keep_quantized: bool = False
    ) -> Iterator[tuple[str, np.ndarray | QuantizedWeight | QuantizedExperts]]:
        """Yield (HF name, weight) one tensor at a time, so peak memory stays near one tensor
        beyond the memory-mapped file.

        Weights are float32 arrays, except that with keep_quantized every 2-D block-quantized
        tensor comes as the QuantizedWeight that dequantizes to exactly that array (stacked experts
        as QuantizedExperts).
        """
        logger.info("%s: %s", os.path.basename(self.path), self._type_summary(keep_quantized))
        arch = self.hf_config["model_type"]
        experts = _has_experts(self.hf_config)
        permuted_heads = {}
        pending: dict[str, np.ndarray] = {}  # qwen3next: a layer's attn_qkv or attn_gate until the other comes
        if arch == "llama":
            permuted_heads = {
                "attn_q": self.hf_config["num_attention_heads"],
                "attn_k": self.hf_config["num_key_value_heads"],
            }
        by_name = {t.name: t for t in self._reader.tensors}
        for tensor in self._reader.populated([t for t in self._reader.tensors if t.name not in _CONFIG_TENSORS]):
            hf_name = _hf_tensor_name(tensor.name, arch, experts)
            assert hf_name is not None, "load_gguf validated every tensor name"
            shape, data = numpy_shape(tensor), tensor.data
            match = _LAYER_TENSOR_RE.fullmatch(tensor.name)
            if match is not None and match[2] in SPLIT_KV_B:
                if match[2] == "attn_v_b":  # the pair as one kv_b_proj, at the second of them
                    yield hf_name, self._kv_b(by_name[tensor.name.replace("attn_v_b", "attn_k_b")], tensor)
                continue
            n_head = permuted_heads.get(match[2]) if match is not None else None
            if n_head is not None and len(shape) == 2:
                # Rows are output channels, whole blocks each: reorder the stored rows once rather
                # than the decoded codes, scales and zeros (torch's strided uint8 copy of the codes
                # cost 1.8 s of the default model's 2.2 s load on a busy machine).
                data, n_head = _unpermute(data.reshape(shape[0], -1), n_head), None
            weight: np.ndarray | QuantizedWeight | QuantizedExperts
            if keep_quantized and _keeps_quantized(tensor, arch):
                weight = quantized_tensor(data, tensor.tensor_type, shape)
            else:
                array = dequantize(data, tensor.tensor_type, shape)
                # Only arrays reach these: a kept-quantized tensor is a matrix (n_head was cleared
                # above) and never a norm.
                if n_head is not None:
                    array = _unpermute(array, n_head)
                if arch in _GEMMA and tensor.name.endswith("norm.weight"):
                    array = unshift_norm(array)
                weight = qwen3next.fix(hf_name, array) if arch == qwen3next.ARCH else array
            if arch == qwen3next.ARCH and hf_name.endswith(qwen3next.MERGED):
                assert isinstance(weight, np.ndarray), "_keeps_quantized leaves the split in_proj_qkvz as floats"
                layer = hf_name.rsplit(".", 3)[0]  # model.layers.N
                pending[hf_name] = weight
                qkv, z = (pending.get(f"{layer}.{part}") for part in qwen3next.MERGED)
                if qkv is not None and z is not None:
                    del pending[f"{layer}.{qwen3next.MERGED[0]}"], pending[f"{layer}.{qwen3next.MERGED[1]}"]
                    yield f"{layer}.linear_attn.in_proj_qkvz.weight", qwen3next.merge_qkvz(qkv, z, self.hf_config)
                continue
            yield hf_name, weight

    def _kv_b(self, k_b: GGUFTensor, v_b: GGUFTensor) -> np.ndarray:
        """deepseek2's kv_b_proj from newer converters' attn_k_b and attn_v_b (ember/model/gguf_moe.py)."""
        k, v = (dequantize(t.data, t.tensor_type, numpy_shape(t)) for t in (k_b, v_b))
        return join_kv_b(k, v, self.hf_config["num_attention_heads"], self.hf_config["kv_lora_rank"])

    def _type_summary(self, keep_quantized: bool) -> str:
        """One line: each tensor type with its count and what it becomes, e.g.
        "F32 x 49 -> float, IQ3_S x 24 -> int8 g32 (kept), Q4_K x 120 -> int4 g32 (kept)"."""
        forms = Counter(
            (t.tensor_type.name, _form(t, keep_quantized, self.hf_config["model_type"]))
            for t in self._reader.tensors
            if t.name not in _CONFIG_TENSORS
        )
        return ", ".join(f"{name} x {count} -> {form}" for (name, form), count in sorted(forms.items()))


def _form(tensor: GGUFTensor, keep_quantized: bool, arch: str) -> str:
    if keep_quantized and _keeps_quantized(tensor, arch):
        return f"{quantized_form(tensor.tensor_type)} (kept)"
    return "float" if tensor.tensor_type in FLOAT_TYPES else "decoded to float"


def _has_experts(hf_config: dict) -> bool:
    return bool(hf_config.get("num_experts") or hf_config.get("num_local_experts"))


def _known_tensor_names(arch: str, experts: bool) -> str:
    layer = (f"blk.N.{name}.weight" for name in _layer_tensors(arch, experts))
    return ", ".join([*_global_tensors(arch), *sorted(_CONFIG_TENSORS), *layer]) + " (and .bias of blk.N tensors)"


def _keeps_quantized(tensor: GGUFTensor, arch: str) -> bool:
    """Matrices of a type with an exact QuantizedWeight form stay quantized (vectors are small), and so do
    stacked experts; a MoE router never does (it is small, and decides which experts run at all), nor the
    tensors an architecture reorders or regroups at load (_DENSE: Llama 4's q and k, Qwen3-Next's halves of
    in_proj_qkvz)."""
    if tensor.tensor_type not in QUANTIZED_TYPES or ".ffn_gate_inp." in tensor.name:
        return False
    match = _LAYER_TENSOR_RE.fullmatch(tensor.name)
    if match is not None and match[2] in _DENSE.get(arch, ()):
        return False
    return len(numpy_shape(tensor)) == (3 if tensor.name.endswith("_exps.weight") else 2)


def quantized_tensor(data: np.ndarray, qtype, shape: tuple[int, ...]) -> QuantizedWeight | QuantizedExperts:
    """A matrix's QuantizedWeight; stacked experts [E, N, K] as the rows of one [E * N, K] matrix, which
    every block type stores exactly as it stores E matrices one after another (int5 widened to int8, Q4_1's
    runs in Ember's int4 packing: what the expert kernels take)."""
    if len(shape) == 2:
        return quantized(data, qtype, shape)
    e, n, k = shape
    w = packed(widen_int5(quantized(data, qtype, (e * n, k))))
    return QuantizedExperts(
        w.kind,
        w.qweight.view(e, n, -1),
        w.scales.view(e, n, -1),
        None if w.zeros is None else w.zeros.view(e, n, -1),
        w.group_size,
        w.in_features,
    )


def numpy_shape(tensor: GGUFTensor) -> tuple[int, ...]:
    """GGML lists dimensions innermost first; numpy wants them outermost first.

    Leading 1s are dropped because a writer may pad a vector to 2-D, which HF never does.
    """
    shape = tuple(reversed(tensor.shape))
    while len(shape) > 1 and shape[0] == 1 and tensor.name not in _TABLES:
        shape = shape[1:]
    return shape


def load_gguf(path: str) -> GGUFModel:
    """Open a GGUF file and translate its metadata; weights stay memory-mapped until tensors()."""
    path = str(path)
    if not os.path.exists(path):
        raise ModelLoadError(path, "file not found")
    meta = open_gguf(path, lazy_strings=True)  # the core reads the vocabulary's strings only for grammars
    reader = meta.reader
    assert reader is not None  # open_gguf keeps the file's reader

    arch = meta.require("general.architecture")
    if arch == "clip":
        raise ModelLoadError(
            path, "a llama.cpp vision projector (mmproj), not a language model: give it as --mmproj beside the model"
        )
    if arch not in ARCHITECTURES:
        raise ModelLoadError(path, f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    names = {tensor.name for tensor in reader.tensors}
    experts = bool(meta.get(f"{arch}.expert_count"))
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_TENSORS:
            continue
        if _hf_tensor_name(tensor.name, arch, experts) is None:
            raise ModelLoadError(
                path,
                f"unexpected tensor {tensor.name!r} for architecture {arch!r} "
                f"(supported: {_known_tensor_names(arch, experts)})",
            )
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(
                path,
                f"tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name} "
                f"(supported: {supported_names()})",
            )

    vocab = GGUFVocab.read(meta)
    if arch in ENCODER_LAYER_TENSORS:
        types = next((t for t in reader.tensors if t.name == "token_types.weight"), None)
        hf_config = encoder_config(meta, vocab, arch, None if types is None else numpy_shape(types)[0])
        return GGUFModel(path=path, hf_config=hf_config, vocab=vocab, _reader=reader)
    hf_config = _hf_config(meta, arch, names, len(vocab.tokens), vocab.bos_id, vocab.eos_id)
    if arch == "qwen2vl":
        hf_config["mrope_section"] = _mrope_section(meta, hf_config["head_dim"])
    if arch == "phi3":
        hf_config.update(_phi3_config(meta, hf_config, {t.name: t for t in reader.tensors}))
    if arch == qwen3next.ARCH:
        hf_config.update(qwen3next.config(meta, hf_config["head_dim"]))
    if arch == "deepseek2":
        hf_config.update(deepseek2_config(meta, names, hf_config["rope_scaling"]))
    if arch == "llama4":
        hf_config.update(llama4_config(meta))
    if arch in ("llama", "llama4"):
        hf_config.update(_rope_freqs_scaling(meta, reader, hf_config["rope_scaling"]))
    return GGUFModel(path=path, hf_config=hf_config, vocab=vocab, _reader=reader)


def _rope_freqs_scaling(meta: GGUFMetadata, reader: GGUFFile, rope_scaling: dict | None) -> dict:
    """llama3 rope scaling as llama.cpp writes it (Llama 3.1 on, Llama 4): no scaling keys, but the
    `rope_freqs` tensor, each frequency's divisor (rope type "freq_factors"). Without it a Llama 3.1 file's
    low frequencies ran unscaled: its greedy tokens' logprobs were 0.02 off its twin's in a tiny model."""
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is None:
        return {}
    if rope_scaling is not None:
        raise ModelLoadError(meta.path, f"rope_freqs beside rope scaling {rope_scaling['rope_type']!r}")
    factors = dequantize(freqs.data, freqs.tensor_type, numpy_shape(freqs))
    return {"rope_scaling": {"rope_type": "freq_factors", "freq_factors": factors.tolist()}}


def _hf_config(
    meta: GGUFMetadata,
    arch: str,
    tensor_names: set[str],
    n_tokens: int,
    bos_id: int | None,
    eos_id: int | None,
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
        **_sliding_window_config(meta, arch),
        **_moe_config(meta, arch, tensor_names),  # last: a llama file with experts (and a window) is Mixtral
    }


def _mrope_section(meta: GGUFMetadata, head_dim: int) -> list[int]:
    """llama.cpp's M-RoPE sections (rotary pairs of each head per position stream: time, row, column and
    a fourth, 0 for Qwen2-VL and 2.5-VL) as transformers' three mrope_section."""
    sections = [int(x) for x in meta.require("qwen2vl.rope.dimension_sections")]
    if len(sections) not in (3, 4) or any(sections[3:]) or sum(sections) != head_dim // 2:
        raise ModelLoadError(
            meta.path,
            f"qwen2vl.rope.dimension_sections {sections}: expected three sections (and a fourth of 0) summing to "
            f"half the head size, {head_dim // 2}",
        )
    return sections[:3]


def _moe_config(meta: GGUFMetadata, arch: str, tensor_names: set[str]) -> dict:
    """The HF config keys of a mixture of experts. llama.cpp renormalises the top-k weights of both
    (Qwen3-MoE's released models set norm_topk_prob too), and a layer without a router is dense."""
    experts = meta.get(f"{arch}.expert_count")
    if not experts or arch in MOE_LAYER_TENSORS:  # those families' own keys: ember/model/gguf_moe.py
        return {}
    top_k = meta.require(f"{arch}.expert_used_count")
    if arch == "llama":  # Mixtral, whose feed_forward_length is one expert's
        return {"architectures": ["MixtralForCausalLM"], "num_local_experts": experts, "num_experts_per_tok": top_k}
    if arch == "gpt-oss":  # every layer sparse; transformers' intermediate_size is one expert's
        return {
            "num_local_experts": experts,
            "num_experts_per_tok": top_k,
            "intermediate_size": meta.require(f"{arch}.expert_feed_forward_length"),
        }
    layers = meta.require(f"{arch}.block_count")
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "norm_topk_prob": True,
        "moe_intermediate_size": meta.require(f"{arch}.expert_feed_forward_length"),
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
    }


# llama.cpp's fixed Gemma facts (llama-model.cpp): every 2nd (Gemma 2) / 6th (Gemma 3) layer is global,
# Gemma 3's local layers use rope base 10000 unscaled, and the 27B models scale attention by
# hidden / heads instead of head_dim (as their query_pre_attn_scalar says); llama.cpp knows them by depth.
_GEMMA_PERIOD = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _sliding_window_config(meta: GGUFMetadata, arch: str) -> dict:
    """The HF config keys for sliding windows, soft caps and Gemma's attention scale. A llama file
    with a window (`llama.attention.sliding_window`, which gguf.GGUFWriter.add_sliding_window writes)
    is a Mistral model with sliding-window attention."""
    window = meta.get(f"{arch}.attention.sliding_window")
    if arch == "phi3":  # _phi3_config reads its window
        return {}
    if arch == "gpt-oss":  # llama.cpp's fixed pattern: even layers slide, odd ones are global
        layers = meta.require(f"{arch}.block_count")
        return {
            "sliding_window": window,
            "layer_types": ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)],
        }
    if arch not in _GEMMA:
        return {} if window is None else {"architectures": ["MistralForCausalLM"], "sliding_window": window}
    hidden = meta.require(f"{arch}.embedding_length")
    heads = meta.require(f"{arch}.attention.head_count")
    layers = meta.require(f"{arch}.block_count")
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    config = {
        "sliding_window": window,
        "sliding_window_pattern": meta.get(f"{arch}.attention.sliding_window_pattern", _GEMMA_PERIOD[arch]),
        "query_pre_attn_scalar": hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim,
        "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping", 30.0 if arch == "gemma2" else None),
    }
    if arch == "gemma2":
        config["attn_logit_softcapping"] = meta.get("gemma2.attn_logit_softcapping", 50.0)
    else:
        config["rope_local_base_freq"] = 10_000.0
    return config


def _phi3_config(meta: GGUFMetadata, hf_config: dict, tensors: dict[str, GGUFTensor]) -> dict:
    """What llama.cpp's converter keeps of Phi-3's config apart from the common keys: the rotated share
    of a head (Phi-4-mini rotates 3/4), the sliding window (0: none) and LongRoPE, whose factors are
    tensors and whose cos/sin scale is precomputed."""
    head_dim = hf_config["head_dim"]
    rotary = meta.get("phi3.rope.dimension_count", head_dim)
    partial = rotary / head_dim
    if int(head_dim * partial) < rotary:  # HF truncates head_dim * factor; keep the product exact
        partial = math.nextafter(partial, 2.0)
    extra = {"partial_rotary_factor": partial, "sliding_window": meta.get("phi3.attention.sliding_window") or None}
    if all(name in tensors for name in _ROPE_FACTORS.values()):
        original = meta.require("phi3.rope.scaling.original_context_length")
        rope = {
            key: dequantize(tensors[name].data, tensors[name].tensor_type, numpy_shape(tensors[name])).tolist()
            for key, name in _ROPE_FACTORS.items()
        }
        rope.update(rope_type="longrope", original_max_position_embeddings=original)
        attention_factor = meta.get("phi3.rope.scaling.attn_factor")
        if attention_factor is not None:
            rope["attention_factor"] = attention_factor
        extra.update(rope_scaling=rope, original_max_position_embeddings=original)
    return extra


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
            "original_max_position_embeddings": meta.require(f"{arch}.rope.scaling.original_context_length"),
            # gpt-oss's config.json (which the file does not carry) turns truncation off; transformers'
            # default, and so other models', is on
            "truncate": arch != "gpt-oss",
        }
    raise ModelLoadError(meta.path, f"unsupported rope scaling type {kind!r}")
