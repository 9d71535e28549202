"""llama.cpp's vision projector files (`--mmproj`): Gemma 3 as llama.cpp ships it is two GGUF files, the
language model (architecture "gemma3") and its SigLIP tower with the projector (architecture "clip",
`clip.projector_type` "gemma3", what `convert_hf_to_gguf.py --mmproj` writes). This module reads the
second in transformers' terms: SiglipVisionConfig's keys, the image processor's mean and std, and the
tensors under Gemma3ForConditionalGeneration's names; `multimodal_config` joins it to the first, so the
pair loads as the HF checkpoint does (ember/model/siglip.py runs it).

What llama.cpp's converter (Gemma3VisionModel) does to the tensors, undone here: `mm.soft_emb_norm` holds
Gemma's 1 + w (SigLIP's LayerNorms are stored as they are); the others keep transformers' layout (the
patch embedding [hidden, 3, p, p]; the input projection [vision hidden, text hidden], which clip.cpp
transposes at run time), in F16 or F32 (the converter forces the projection to F16, the embeddings to
F32) or block-quantized, all decoded to float32: the tower stays as loaded. The image tokens are not in
the file: clip.cpp pools each side of the patch grid by 4 (`clip.vision.projector.scale_factor` where a
test model differs), 16 x 16 = 256 tokens for Gemma 3's 896-pixel images of 14-pixel patches, and their
ids are the vocabulary's `<start_of_image>`, `<end_of_image>` and `<image_soft_token>`.

Qwen2.5-VL likewise (Qwen2VLVisionModel, `clip.projector_type` "qwen2.5vl_merger", beside a "qwen2vl"
language model: Qwen2 with M-RoPE's `rope.dimension_sections`), read as Qwen2_5_VLForConditionalGeneration
(ember/model/qwen2_5_vl.py). Undone here: the converter splits the Conv3d patch embedding into one 2-D
kernel per frame (`v.patch_embd.weight`, `v.patch_embd.weight.1`, stacked back on the temporal axis) and
each block's fused qkv into attn_q, attn_k and attn_v (concatenated back; a fused attn_qkv is taken as
it is). The file does not store what clip.cpp fixes for the type: the window (112 pixels a side), the
spatial merge (2; `clip.vision.spatial_merge_size` and `clip.vision.window_size` where written); the
full-attention blocks are every `clip.vision.n_wa_pattern`-th (`fullatt_block_indexes` [n-1, 2n-1, ...]).
Images keep Qwen's own sizes (transformers' smart_resize; `clip.vision.image_min_pixels` and
`image_max_pixels` where written, else transformers' defaults), and each image's token count follows
from its size, as with the HF checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ember.errors import ModelLoadError
from ember.model.files import projector_image_processor
from ember.model.gguf import numpy_shape, unshift_norm
from ember.model.gguf_blocks import SUPPORTED_TYPES, dequantize, supported_names
from ember.model.gguf_reader import GGUFFile
from ember.model.gguf_tokenizer import GGUFMetadata, open_gguf

GEMMA3, QWEN25VL = "gemma3", "qwen2.5vl_merger"
PROJECTOR_TYPES = (GEMMA3, QWEN25VL)
# the language models each projector type goes with (general.architecture of the text file)
TEXT_ARCHITECTURES = {GEMMA3: "gemma3", QWEN25VL: "qwen2vl"}
_TOWER = "vision_tower.vision_model."
# gguf-py's tensor_mapping for MODEL_ARCH.MMPROJ run backwards (SigLIP and Gemma 3's projector)
_GLOBAL_TENSORS = {
    "v.patch_embd.weight": _TOWER + "embeddings.patch_embedding.weight",
    "v.patch_embd.bias": _TOWER + "embeddings.patch_embedding.bias",
    "v.position_embd.weight": _TOWER + "embeddings.position_embedding.weight",
    "v.post_ln.weight": _TOWER + "post_layernorm.weight",
    "v.post_ln.bias": _TOWER + "post_layernorm.bias",
    "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
    "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
# Qwen2.5-VL's tower and merger (gguf-py's qwen2vl rows): HF name, and for a part of a tensor the
# converter split, its index among how many
_QWEN_GLOBAL_TENSORS = {
    "v.patch_embd.weight": ("visual.patch_embed.proj.weight", 0, 2),
    "v.patch_embd.weight.1": ("visual.patch_embed.proj.weight", 1, 2),
    "v.post_ln.weight": ("visual.merger.ln_q.weight", 0, 1),
    "mm.0.weight": ("visual.merger.mlp.0.weight", 0, 1),
    "mm.0.bias": ("visual.merger.mlp.0.bias", 0, 1),
    "mm.2.weight": ("visual.merger.mlp.2.weight", 0, 1),
    "mm.2.bias": ("visual.merger.mlp.2.bias", 0, 1),
}
_QWEN_LAYER_TENSORS = {
    "attn_q": ("attn.qkv", 0, 3),
    "attn_k": ("attn.qkv", 1, 3),
    "attn_v": ("attn.qkv", 2, 3),
    "attn_qkv": ("attn.qkv", 0, 1),
    "attn_out": ("attn.proj", 0, 1),
    "ln1": ("norm1", 0, 1),
    "ln2": ("norm2", 0, 1),
    "ffn_gate": ("mlp.gate_proj", 0, 1),
    "ffn_up": ("mlp.up_proj", 0, 1),
    "ffn_down": ("mlp.down_proj", 0, 1),
}
_PATCH_KERNELS = "visual.patch_embed.proj.weight"  # its parts are frames: stacked on a new axis 2
_LAYER_TENSOR_RE = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")
_SHIFTED_NORM = "mm.soft_emb_norm.weight"
_SCALE_FACTOR = 4  # clip.cpp's pooling of each side for Gemma 3 (all released sizes)
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
QWEN_IMAGE_TOKENS = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
# what clip.cpp fixes for Qwen2.5-VL where the file is silent
_QWEN_WINDOW, _QWEN_MERGE = 112, 2

Part = tuple[str, int, int]  # HF name, this tensor's index among the parts, how many parts


def _hf_tensor_name(name: str, kind: str) -> Part | None:
    if kind == QWEN25VL:
        if name in _QWEN_GLOBAL_TENSORS:
            return _QWEN_GLOBAL_TENSORS[name]
        match = _LAYER_TENSOR_RE.fullmatch(name)
        if match is None or match[2] not in _QWEN_LAYER_TENSORS:
            return None
        hf, index, parts = _QWEN_LAYER_TENSORS[match[2]]
        return f"visual.blocks.{match[1]}.{hf}.{match[3]}", index, parts
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name], 0, 1
    match = _LAYER_TENSOR_RE.fullmatch(name)
    if match is None or match[2] not in _LAYER_TENSORS:
        return None
    return f"{_TOWER}encoder.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.{match[3]}", 0, 1


def _joined(name: str, parts: list[np.ndarray]) -> np.ndarray:
    """A tensor the converter split, whole again: the patch kernels' frames, or q, k and v."""
    if len(parts) == 1:
        return parts[0]
    return np.stack(parts, axis=2) if name == _PATCH_KERNELS else np.concatenate(parts, axis=0)


@dataclass
class Mmproj:
    """A projector file in HF terms, from one parse; tensors() decodes the weights."""

    path: str
    kind: str  # the projector type (PROJECTOR_TYPES)
    vision_config: dict[str, Any]  # transformers' SiglipVisionConfig keys, or Qwen2.5-VL's vision_config
    tokens_per_image: int  # Gemma 3's; 0: each image's follows from its size (Qwen2.5-VL)
    projection_dim: int  # the language model's hidden size it projects to
    image_processor: dict[str, Any]  # preprocessor_config.json's image_mean and image_std (min/max_pixels)
    _reader: GGUFFile = field(repr=False)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float32 array), one tensor at a time (a split one once its last part is read)."""
        pending: dict[str, list[np.ndarray | None]] = {}
        for tensor in self._reader.populated(self._reader.tensors):
            part = _hf_tensor_name(tensor.name, self.kind)
            assert part is not None, "load_mmproj validated every tensor name"
            name, index, count = part
            array = dequantize(tensor.data, tensor.tensor_type, numpy_shape(tensor))
            array = unshift_norm(array) if tensor.name == _SHIFTED_NORM else array
            slots = pending.setdefault(name, [None] * count)
            slots[index] = array
            if all(slot is not None for slot in slots):
                del pending[name]
                yield name, _joined(name, [slot for slot in slots if slot is not None])
        assert not pending, "load_mmproj checked that every split tensor has all its parts"


def load_mmproj(path: str) -> Mmproj:
    """Open a projector file and check it is one Ember runs; weights stay memory-mapped until tensors()."""
    meta = open_gguf(path)
    reader = meta.reader
    assert reader is not None  # open_gguf keeps the file's reader
    arch = meta.get("general.architecture")
    if arch != "clip":
        raise ModelLoadError(
            path,
            f"not a llama.cpp vision projector: general.architecture is {arch!r}, not 'clip' (what "
            "convert_hf_to_gguf.py --mmproj writes)",
        )
    if not meta.get("clip.has_vision_encoder", False):
        raise ModelLoadError(path, "clip.has_vision_encoder is not true: no vision encoder (an audio projector?)")
    kind = projector_type(meta)
    if kind not in PROJECTOR_TYPES:
        raise ModelLoadError(
            path, f"projector_type {kind!r} is not supported (supported: {', '.join(PROJECTOR_TYPES)})"
        )
    _check_tensors(path, reader, kind)
    if kind == QWEN25VL:
        return Mmproj(
            path=path,
            kind=kind,
            vision_config=_qwen_vision_config(meta),
            tokens_per_image=0,
            projection_dim=meta.require("clip.vision.projection_dim"),
            image_processor=projector_image_processor(meta),
            _reader=reader,
        )
    vision = _vision_config(meta)
    side = vision["image_size"] // vision["patch_size"]
    factor = meta.get("clip.vision.projector.scale_factor", _SCALE_FACTOR)
    if factor < 1 or side % factor:
        raise ModelLoadError(
            path, f"clip.vision.projector.scale_factor {factor} does not divide the {side} patches per side"
        )
    return Mmproj(
        path=path,
        kind=kind,
        vision_config=vision,
        tokens_per_image=(side // factor) ** 2,
        projection_dim=meta.require("clip.vision.projection_dim"),
        image_processor={key: list(meta.require(f"clip.vision.{key}")) for key in ("image_mean", "image_std")},
        _reader=reader,
    )


def _check_tensors(path: str, reader: GGUFFile, kind: str) -> None:
    """Every tensor one of the projector's, of a type Ember decodes, and every split tensor whole."""
    parts: dict[str, set[int]] = {}
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        part = _hf_tensor_name(tensor.name, kind)
        if part is None:
            raise ModelLoadError(path, f"unexpected tensor {tensor.name!r} for a {kind} projector")
        if tensor.tensor_type not in SUPPORTED_TYPES:
            supported = supported_names()
            raise ModelLoadError(
                path, f"tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name} (supported: {supported})"
            )
        parts.setdefault(part[0], set()).add(part[1])
        counts[part[0]] = part[2]
    for name, found in parts.items():
        if len(found) != counts[name]:
            raise ModelLoadError(path, f"{name} is split in {counts[name]} tensors, but the file holds {len(found)}")


def projector_type(meta: GGUFMetadata) -> str | None:
    """The vision projector's type: `clip.vision.projector_type` (files with an audio encoder too), else
    `clip.projector_type`, as clip.cpp reads them."""
    return meta.get("clip.vision.projector_type") or meta.get("clip.projector_type")


def _vision_config(meta: GGUFMetadata) -> dict[str, Any]:
    if meta.get("clip.use_silu", False) or not meta.get("clip.use_gelu", False):
        raise ModelLoadError(meta.path, "clip.use_gelu is not true: Gemma 3's SigLIP uses GELU (tanh)")
    return {
        "hidden_size": meta.require("clip.vision.embedding_length"),
        "intermediate_size": meta.require("clip.vision.feed_forward_length"),
        "num_hidden_layers": meta.require("clip.vision.block_count"),
        "num_attention_heads": meta.require("clip.vision.attention.head_count"),
        "image_size": meta.require("clip.vision.image_size"),
        "patch_size": meta.require("clip.vision.patch_size"),
        "layer_norm_eps": meta.require("clip.vision.attention.layer_norm_epsilon"),
        "hidden_act": "gelu_pytorch_tanh",  # ggml_gelu: the tanh approximation
    }


def _qwen_vision_config(meta: GGUFMetadata) -> dict[str, Any]:
    """Qwen2.5-VL's vision_config keys (ember.model.hf_config reads them as QwenVisionConfig)."""
    if not meta.get("clip.use_silu", False):
        raise ModelLoadError(meta.path, "clip.use_silu is not true: Qwen2.5-VL's tower uses SiLU")
    depth = meta.require("clip.vision.block_count")
    wa_layers = meta.get("clip.vision.wa_layer_indexes")
    if wa_layers is not None:
        full = [int(i) for i in wa_layers]
    else:
        pattern = meta.get("clip.vision.n_wa_pattern", 0)
        if pattern < 1:
            raise ModelLoadError(meta.path, "no clip.vision.n_wa_pattern: which blocks attend in full is not known")
        full = list(range(pattern - 1, depth, pattern))
    return {
        "depth": depth,
        "hidden_size": meta.require("clip.vision.embedding_length"),
        "intermediate_size": meta.require("clip.vision.feed_forward_length"),
        "num_heads": meta.require("clip.vision.attention.head_count"),
        "out_hidden_size": meta.require("clip.vision.projection_dim"),
        "patch_size": meta.require("clip.vision.patch_size"),
        "temporal_patch_size": 2,  # the two kernels, checked with the tensors
        "spatial_merge_size": meta.get("clip.vision.spatial_merge_size", _QWEN_MERGE),
        "window_size": meta.get("clip.vision.window_size", _QWEN_WINDOW),
        "fullatt_block_indexes": full,
        "hidden_act": "silu",
    }


def multimodal_config(text_config: dict[str, Any], tokens: Sequence[str], text_path: str, proj: Mmproj) -> dict:
    """The language model's config (from its GGUF file) and the projector's joined as transformers'
    Gemma3Config or Qwen2_5_VLConfig; a ModelLoadError when the projector does not fit the language model."""
    arch = text_config["model_type"]
    kind = proj.kind
    if arch != TEXT_ARCHITECTURES[kind]:
        raise ModelLoadError(
            proj.path,
            f"a {kind} vision projector, but the language model {text_path} is {arch!r} "
            f"(it goes with {TEXT_ARCHITECTURES[kind]!r})",
        )
    if proj.projection_dim != text_config["hidden_size"]:
        raise ModelLoadError(
            proj.path,
            f"projects images to {proj.projection_dim}-wide embeddings (clip.vision.projection_dim), but the "
            f"language model {text_path} is {text_config['hidden_size']} wide: a projector of another model",
        )
    if kind == QWEN25VL:
        return _qwen_config(text_config, tokens, text_path, proj)
    boi, eoi, image = _token_ids(tokens, IMAGE_TOKENS, text_path, "Gemma 3")
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text_config,
        "vision_config": proj.vision_config,
        "mm_tokens_per_image": proj.tokens_per_image,
        "boi_token_index": boi,
        "eoi_token_index": eoi,
        "image_token_index": image,
    }


def _qwen_config(text_config: dict[str, Any], tokens: Sequence[str], text_path: str, proj: Mmproj) -> dict:
    image, start, end = _token_ids(tokens, QWEN_IMAGE_TOKENS, text_path, "Qwen2.5-VL")
    section = text_config.get("mrope_section")
    if not section:
        raise ModelLoadError(text_path, "no qwen2vl.rope.dimension_sections: the M-RoPE sections of Qwen2.5-VL")
    rope = {"rope_type": "default", "mrope_section": list(section), "rope_theta": text_config["rope_theta"]}
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "text_config": {**text_config, "rope_parameters": rope},
        "vision_config": proj.vision_config,
        "image_token_id": image,
        "vision_start_token_id": start,
        "vision_end_token_id": end,
    }


def _token_ids(tokens: Sequence[str], wanted: tuple[str, ...], text_path: str, model: str) -> list[int]:
    found: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if token in wanted:
            found.setdefault(token, index)
    missing = [t for t in wanted if t not in found]
    if missing:
        raise ModelLoadError(text_path, f"the vocabulary lacks {model}'s image tokens {missing}")
    return [found[t] for t in wanted]
