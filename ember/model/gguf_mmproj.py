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
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ember.errors import ModelLoadError
from ember.model.gguf import numpy_shape, unshift_norm
from ember.model.gguf_blocks import SUPPORTED_TYPES, dequantize, supported_names
from ember.model.gguf_reader import GGUFFile
from ember.model.gguf_tokenizer import GGUFMetadata, open_gguf

PROJECTOR_TYPES = ("gemma3",)
# the language models each projector type goes with (general.architecture of the text file)
TEXT_ARCHITECTURES = {"gemma3": "gemma3"}
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
_LAYER_TENSOR_RE = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")
_SHIFTED_NORM = "mm.soft_emb_norm.weight"
_SCALE_FACTOR = 4  # clip.cpp's pooling of each side for Gemma 3 (all released sizes)
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def _hf_tensor_name(name: str) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = _LAYER_TENSOR_RE.fullmatch(name)
    if match is None or match[2] not in _LAYER_TENSORS:
        return None
    return f"{_TOWER}encoder.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.{match[3]}"


@dataclass
class Mmproj:
    """A projector file in HF terms, from one parse; tensors() decodes the weights."""

    path: str
    vision_config: dict[str, Any]  # transformers' SiglipVisionConfig keys
    tokens_per_image: int
    projection_dim: int  # the language model's hidden size it projects to
    image_processor: dict[str, Any]  # preprocessor_config.json's image_mean and image_std
    _reader: GGUFFile = field(repr=False)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float32 array), one tensor at a time."""
        for tensor in self._reader.populated(self._reader.tensors):
            name = _hf_tensor_name(tensor.name)
            assert name is not None, "load_mmproj validated every tensor name"
            array = dequantize(tensor.data, tensor.tensor_type, numpy_shape(tensor))
            yield name, unshift_norm(array) if tensor.name == _SHIFTED_NORM else array


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
    for tensor in reader.tensors:
        if _hf_tensor_name(tensor.name) is None:
            raise ModelLoadError(path, f"unexpected tensor {tensor.name!r} for a {kind} projector")
        if tensor.tensor_type not in SUPPORTED_TYPES:
            supported = supported_names()
            raise ModelLoadError(
                path, f"tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name} (supported: {supported})"
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
        vision_config=vision,
        tokens_per_image=(side // factor) ** 2,
        projection_dim=meta.require("clip.vision.projection_dim"),
        image_processor={key: list(meta.require(f"clip.vision.{key}")) for key in ("image_mean", "image_std")},
        _reader=reader,
    )


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


def multimodal_config(text_config: dict[str, Any], tokens: Sequence[str], text_path: str, proj: Mmproj) -> dict:
    """The language model's config (from its GGUF file) and the projector's joined as transformers'
    Gemma3Config; a ModelLoadError when the projector does not fit the language model."""
    arch = text_config["model_type"]
    kind = "gemma3"  # load_mmproj admits no other yet
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
    found: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if token in IMAGE_TOKENS:
            found.setdefault(token, index)
    missing = [t for t in IMAGE_TOKENS if t not in found]
    if missing:
        raise ModelLoadError(text_path, f"the vocabulary lacks Gemma 3's image tokens {missing}")
    boi, eoi, image = (found[t] for t in IMAGE_TOKENS)
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
