"""Gemma 3 as llama.cpp ships it (docs/multimodal.md, "GGUF"): a text GGUF and its vision projector (mmproj)
GGUF, written here from the tiny Gemma 3 checkpoint of tests/vision_fixtures.py as llama.cpp's
convert_hf_to_gguf.py writes them (gguf-py's tensor names, Gemma's 1 + w norms, the converter's tensor
types for --outtype f32 and f16, its metadata).

The pair loads as a Gemma3ForConditionalGeneration: its image features equal HF's and its greedy tokens
equal Ember's and HF's on a "twin" safetensors checkpoint holding exactly what the files decode to (F16
rounds; the converter stores the projection in F16 even for f32). Also: `--mmproj` and `--no-mmproj`, the
projector found beside the model file (one only), and the errors (an unknown projector type, a projector
of another width or for another language model, a projector given as the model or with an HF checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from conftest import close_gguf, default_gguf_path, gguf_writer
from gguf_mmproj_fixtures import Tensors, add_word_vocab, gguf_pair, mmproj_writer, stored
from safetensors.numpy import load_file
from vision_fixtures import BOI, TOKENS_PER_IMAGE, WORDS, hf_greedy, make_gemma3_vision, make_llm, picture

from ember import EngineArgs, SamplingParams
from ember.config import LoadConfig
from ember.errors import ModelLoadError
from ember.model.files import load_model_info
from ember.model.gguf_mmproj import load_mmproj
from ember.model.loader import load_model_files

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [2, 10, 11, 12, BOI, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]  # past the 16-token window
TWO = [2, 30, BOI, 31, 32, BOI, 33, 34]
MEAN, STD = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]  # Gemma 3's preprocessor_config.json
# What llama.cpp runs of Gemma 3 and what it cannot express: every 6th layer global, the local layers'
# rope base 10000 (transformers' default) and attention scaled by head_dim.
GGUF_COMPATIBLE = dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=32)
_SPECIAL = {"<pad>", "<eos>", "<bos>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"}


def _normalized(name: str) -> str:
    """A checkpoint tensor's name as transformers 4 wrote it, which the converter maps."""
    for old, new in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ):
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower.") :]  # transformers 5 drops it
    return name


def _stored(name: str, w: np.ndarray, outtype: str) -> np.ndarray:
    """The converter's tensor types (`stored`), but a Gemma 3 projector's input projection F16 and its
    embeddings F32 whatever the outtype."""
    if "input_projection" in name:
        return w.astype(np.float16)
    if ".embeddings." in name:
        return w.astype(np.float32)
    return stored(name, w, outtype)


def _add_tensors(
    w: gguf.GGUFWriter,
    weights: Tensors,
    names: gguf.TensorNameMap,
    outtype: str,
    rename: Callable[[str], str | None],
    shifted: Callable[[str], bool],
) -> Tensors:
    """Each checkpoint tensor that `rename` gives an HF name (None: the other file's) under its gguf-py name,
    as 1 + w where `shifted` (Gemma's norms); returns what each decodes to."""
    decoded = {}
    for ckpt_name, t in weights.items():
        name = rename(ckpt_name)
        if name is None:
            continue
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        shift = shifted(name)
        data = _stored(name, t + np.float32(1.0) if shift else t, outtype)
        w.add_tensor(new, data)
        value = data.astype(np.float32)
        decoded[ckpt_name] = value - np.float32(1.0) if shift else value
    return decoded


def _text_name(ckpt_name: str) -> str | None:
    name = _normalized(ckpt_name)
    return name if name.startswith(("model.", "lm_head.")) else None


def _vision_name(ckpt_name: str) -> str | None:
    name = _normalized(ckpt_name).replace("_weight", ".weight")
    return name if name.startswith(("vision_tower.", "multi_modal_projector.")) else None


def _write_text(path: Path, ckpt: Path, weights: Tensors, outtype: str) -> Tensors:
    """The language model as Gemma3Model writes it; returns what each tensor decodes to, by checkpoint name."""
    cfg = json.loads((ckpt / "config.json").read_text())["text_config"]
    w = gguf_writer(path, "gemma3", cfg)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_file_type(0 if outtype == "f32" else 1)
    tokens = [*WORDS, "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    # "\n\n" user-defined (4): matched whole, as the HF tokenizer of these tests splits it
    add_word_vocab(w, tokens, [3 if t in _SPECIAL else 4 if t == "\n\n" else 1 for t in tokens])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg["num_hidden_layers"])
    decoded = _add_tensors(w, weights, names, outtype, _text_name, lambda name: name.endswith("norm.weight"))
    close_gguf(w)
    return decoded


def _write_mmproj(
    path: Path,
    ckpt: Path,
    weights: Tensors,
    outtype: str,
    projector_type: str = "gemma3",
    projection_dim: int | None = None,
) -> Tensors:
    """The vision tower and projector as MmprojModel and Gemma3VisionModel write them; returns what each
    tensor decodes to, by checkpoint name."""
    cfg = json.loads((ckpt / "config.json").read_text())
    v = cfg["vision_config"]
    w = mmproj_writer(
        path,
        outtype,
        projector_type,
        v,
        projection_dim=projection_dim or cfg["text_config"]["hidden_size"],
        image_size=v["image_size"],
        blocks=v["num_hidden_layers"],
        heads=v["num_attention_heads"],
        mean=MEAN,
        std=STD,
        eps=v.get("layer_norm_eps", 1e-6),
    )
    w.add_vision_use_gelu(True)
    factor = (v["image_size"] // v["patch_size"]) // int(cfg["mm_tokens_per_image"] ** 0.5)
    if factor != 4:  # written only where it is not llama.cpp's default (a test model)
        w.add_vision_projector_scale_factor(factor)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, v["num_hidden_layers"])
    # soft_emb_norm: the only Gemma norm of the vision side
    decoded = _add_tensors(w, weights, names, outtype, _vision_name, lambda name: "soft_emb_norm.weight" in name)
    close_gguf(w)
    return decoded


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return Path(make_gemma3_vision(tmp_path_factory.mktemp("gemma3") / "hf", **GGUF_COMPATIBLE))


@pytest.fixture(scope="module", params=["f32", "f16"])
def pair(request, hf, tmp_path_factory) -> tuple[str, str, str]:
    """(text GGUF, mmproj GGUF, the twin checkpoint holding what they decode to) for one outtype."""
    outtype = request.param
    return gguf_pair(
        tmp_path_factory.mktemp(f"gguf-{outtype}"),
        hf,
        "gemma-3-tiny",
        lambda path, weights: _write_text(path, hf, weights, outtype),
        lambda path, weights: _write_mmproj(path, hf, weights, outtype),
    )


def test_mmproj_config_equals_the_checkpoints(pair):
    text, mmproj, twin = pair
    files = load_model_files(LoadConfig(text, None, "auto", None, mmproj=mmproj))
    ref = load_model_files(LoadConfig(twin, None, "auto", None)).model_config
    assert files.model_config.architecture == "Gemma3ForConditionalGeneration"
    vision = files.model_config.vision
    assert vision is not None and ref.vision is not None
    assert vision.layer_norm_eps == pytest.approx(ref.vision.layer_norm_eps, rel=1e-7)  # float32 in the file
    assert dataclasses.replace(vision, layer_norm_eps=ref.vision.layer_norm_eps) == ref.vision
    assert files.model_config.layer_types == ref.layer_types
    assert files.model_info().image_processor == {"image_mean": MEAN, "image_std": STD}
    assert load_model_info(EngineArgs(model=text, mmproj=mmproj).load_config()).image_processor == {
        "image_mean": MEAN,
        "image_std": STD,
    }


def test_image_features_equal_hf(pair):
    from ember.runner.model_build import build_model

    text, mmproj, twin = pair
    files = load_model_files(LoadConfig(text, None, "auto", None, mmproj=mmproj))
    ours = build_model(files, files.model_config, 64, torch.float32, torch.device("cpu"), 0)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(twin, dtype=torch.float32).eval()
    pixels = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        ref = model.model.get_image_features(pixel_values=pixels)
        ref = getattr(ref, "pooler_output", ref)
        torch.testing.assert_close(ours.embed_images(pixels), ref.reshape(2, TOKENS_PER_IMAGE, -1), rtol=0, atol=1e-6)


def test_greedy_tokens_equal_safetensors_and_hf(pair):
    text, mmproj, twin = pair
    a, b = picture(1), picture(3, (20, 50))
    prompts = [
        {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": a}},
        {"prompt_token_ids": TWO, "multi_modal_data": {"image": [a, b]}},
    ]
    outs = []
    for model, kwargs in ((text, {"mmproj": mmproj}), (twin, {})):
        llm = make_llm(model, max_model_len=64, **kwargs)
        outs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
        llm.llm_engine.shutdown()
    assert outs[0] == outs[1]
    assert outs[0] == [hf_greedy(twin, PROMPT, [a], 6), hf_greedy(twin, TWO, [a, b], 6)]


def test_projector_beside_the_model_is_found(pair, tmp_path, caplog):
    text, mmproj, _ = pair
    d = tmp_path / "one"
    d.mkdir()
    model = d / "model.gguf"
    model.symlink_to(text)
    (d / "mmproj-model-f16.gguf").symlink_to(mmproj)
    assert load_model_files(LoadConfig(str(model), None, "auto", None)).model_config.vision is not None
    assert load_model_info(EngineArgs(model=str(model)).load_config()).image_processor["image_std"] == STD
    off = load_model_files(EngineArgs(model=str(model), mmproj="none").load_config())
    assert off.model_config.vision is None and off.model_config.architecture == "Gemma3ForCausalLM"
    (d / "mmproj-model-f32.gguf").symlink_to(mmproj)
    with caplog.at_level(logging.WARNING, logger="ember"):
        assert load_model_files(LoadConfig(str(model), None, "auto", None)).model_config.vision is None
    assert "several vision projectors beside it (mmproj-model-f16.gguf, mmproj-model-f32.gguf)" in caplog.text
    chosen = EngineArgs(model=str(model), mmproj=str(d / "mmproj-model-f32.gguf")).load_config()
    assert load_model_files(chosen).model_config.vision is not None
    (d / "mmproj-model-f32.gguf").unlink()
    (d / "mmproj-model-f16.gguf").unlink()
    (d / "mmproj-broken.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="not a valid GGUF file .* --no-mmproj loads it alone"):
        load_model_files(LoadConfig(str(model), None, "auto", None))
    with pytest.raises(ModelLoadError, match="--no-mmproj loads it alone"):
        load_model_info(EngineArgs(model=str(model)).load_config())  # the front end reads its image mean and std


def test_cli_flags():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--mmproj", "p.gguf"])).mmproj == "p.gguf"
    assert EngineArgs.from_cli_args(parser.parse_args(["--no-mmproj"])).mmproj == "none"
    assert EngineArgs.from_cli_args(parser.parse_args([])).mmproj is None


def test_gemma3_4b_header_gives_256_tokens_per_image(tmp_path):
    """Released Gemma 3 projectors write no scale factor: llama.cpp's 4 pools 64 x 64 patches to 16 x 16."""
    path = tmp_path / "mmproj.gguf"
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type("gemma3")
    w.add_vision_use_gelu(True)
    for add, value in [
        ("add_vision_projection_dim", 2560),
        ("add_vision_image_size", 896),
        ("add_vision_patch_size", 14),
        ("add_vision_embedding_length", 1152),
        ("add_vision_feed_forward_length", 4304),
        ("add_vision_block_count", 27),
        ("add_vision_head_count", 16),
        ("add_vision_attention_layernorm_eps", 1e-6),
        ("add_vision_image_mean", MEAN),
        ("add_vision_image_std", STD),
    ]:
        getattr(w, add)(value)
    close_gguf(w)
    proj = load_mmproj(str(path))
    assert proj.tokens_per_image == 256 and proj.projection_dim == 2560
    assert proj.vision_config["image_size"] == 896 and proj.vision_config["hidden_act"] == "gelu_pytorch_tanh"


def test_errors(hf, pair, tmp_path):
    text, mmproj, _ = pair
    weights = load_file(hf / "model.safetensors")
    other = tmp_path / "mmproj-idefics3.gguf"
    _write_mmproj(other, hf, weights, "f16", projector_type="idefics3")
    with pytest.raises(
        ModelLoadError, match=r"projector_type 'idefics3' is not supported \(supported: gemma3, qwen2.5vl_merger\)"
    ):
        load_model_files(LoadConfig(text, None, "auto", None, mmproj=str(other)))
    wide = tmp_path / "mmproj-wide.gguf"
    _write_mmproj(wide, hf, weights, "f16", projection_dim=128)
    with pytest.raises(ModelLoadError, match="projects images to 128-wide embeddings .* is 64 wide"):
        load_model_files(LoadConfig(text, None, "auto", None, mmproj=str(wide)))
    with pytest.raises(ModelLoadError, match="language model .* is 'llama' \\(it goes with 'gemma3'\\)"):
        load_model_files(LoadConfig(default_gguf_path(), None, "auto", None, mmproj=mmproj))
    with pytest.raises(ModelLoadError, match="a llama.cpp vision projector \\(mmproj\\), not a language model"):
        load_model_files(LoadConfig(mmproj, None, "auto", None))
    with pytest.raises(ModelLoadError, match="--mmproj goes with a .gguf language model"):
        load_model_info(EngineArgs(model=str(hf), mmproj=mmproj).load_config())
    with pytest.raises(ModelLoadError, match="file not found"):
        load_model_files(LoadConfig(text, None, "auto", None, mmproj=str(tmp_path / "missing.gguf")))
