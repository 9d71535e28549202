"""What the llama.cpp vision tests share (tests/test_gguf_mmproj.py: Gemma 3, tests/test_gguf_mmproj_qwen.py:
Qwen2.5-VL): the parts of a text GGUF and its vision projector (mmproj) GGUF that convert_hf_to_gguf.py
writes alike for every model, and the pair of files with the "twin" checkpoint holding what they decode to.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from conftest import save_twin
from safetensors.numpy import load_file

Tensors = dict[str, np.ndarray]  # by checkpoint name: its weights, or what each tensor written decodes to
Writer = Callable[[Path, Tensors], Tensors]  # writes a file of the weights, returns what it decodes to


def stored(name: str, w: np.ndarray, outtype: str) -> np.ndarray:
    """The converter's tensor types: 1-D tensors and norms F32, the rest the outtype."""
    if w.ndim <= 1 or name.endswith("norm.weight") or outtype == "f32":
        return w.astype(np.float32)
    return w.astype(np.float16)


def add_word_vocab(w: gguf.GGUFWriter, tokens: list[str], types: list[int]) -> None:
    """A word-level vocabulary as a llama (SentencePiece) tokenizer with no scores and no space prefix: how the
    tests' word-level HF tokenizers go into a GGUF file."""
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_add_space_prefix(False)


def mmproj_writer(
    path: Path,
    outtype: str,
    projector_type: str,
    vision: dict,
    *,
    projection_dim: int,
    image_size: int,
    blocks: int,
    heads: int,
    mean: list[float],
    std: list[float],
    eps: float,
) -> gguf.GGUFWriter:
    """A projector file's writer holding the keys MmprojModel writes for every model; `vision` is the
    checkpoint's vision_config (the keys its models name alike), the rest what each names its own way."""
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type(0 if outtype == "f32" else 1)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(projection_dim)
    w.add_vision_image_size(image_size)
    w.add_vision_patch_size(vision["patch_size"])
    w.add_vision_embedding_length(vision["hidden_size"])
    w.add_vision_feed_forward_length(vision["intermediate_size"])
    w.add_vision_block_count(blocks)
    w.add_vision_head_count(heads)
    w.add_vision_image_mean(mean)
    w.add_vision_image_std(std)
    w.add_clip_projector_type(projector_type)
    w.add_vision_attention_layernorm_eps(eps)
    return w


def gguf_pair(root: Path, hf: Path, stem: str, write_text: Writer, write_mmproj: Writer) -> tuple[str, str, str]:
    """(text GGUF, mmproj GGUF, twin) written under root from the checkpoint hf, the twin holding what the two
    files decode to."""
    weights = load_file(hf / "model.safetensors")
    text, mmproj, twin = root / f"{stem}.gguf", root / f"mmproj-{stem}.gguf", root / "twin"
    decoded = write_text(text, weights) | write_mmproj(mmproj, weights)
    assert decoded.keys() == weights.keys()  # every tensor went to one file or the other
    save_twin(hf, twin, decoded)
    return str(text), str(mmproj), str(twin)
