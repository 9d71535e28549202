"""Qwen2.5-VL as llama.cpp ships it (docs/multimodal.md, "GGUF"): a `qwen2vl` text GGUF (Qwen2 with M-RoPE's
`rope.dimension_sections`) and its `qwen2.5vl_merger` projector GGUF, written here from the tiny Qwen2.5-VL
checkpoint of tests/qwen_vl_fixtures.py as convert_hf_to_gguf.py writes them (Qwen2VLModel and
Qwen2VLVisionModel: gguf-py's tensor names, the Conv3d patch embedding split into one kernel per frame,
each block's qkv split into q, k and v, `clip.vision.n_wa_pattern`, no window size: clip.cpp's 112 pixels).

The pair loads as a Qwen2_5_VLForConditionalGeneration: its tower's features equal HF's and its greedy
tokens equal Ember's and HF's on a "twin" safetensors checkpoint holding exactly what the files decode
to; the text file alone loads as Qwen2 (M-RoPE is plain rotary for text). Also the errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from conftest import close_gguf, gguf_writer
from gguf_mmproj_fixtures import Tensors, add_word_vocab, gguf_pair, mmproj_writer, stored
from qwen_vl_fixtures import END, PAD, START, WORDS, hf_greedy, make_llm, make_qwen25_vl, picture
from safetensors.numpy import load_file

from ember import SamplingParams
from ember.config import LoadConfig
from ember.errors import ModelLoadError
from ember.model.loader import load_model_files
from ember.multimodal.qwen2_vl import CLIP_MEAN, CLIP_STD

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# what clip.cpp can run: its fixed 112-pixel window (4 x 4 merged tokens)
GGUF_COMPATIBLE = dict(window_size=112)
TOKENS = [*WORDS, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "[PAD399]"]
BIG, SMALL = (140, 84), (56, 56)  # patch grids 6 x 10 (two windows a row, cut) and 4 x 4
ONE = [2, 10, 11, START, PAD, END, 12, 13, 14]
TWO = [2, 30, START, PAD, END, 31, 32, START, PAD, END, 33, 34]


def _write_text(path: Path, ckpt: Path, weights: Tensors, outtype: str, sections: list[int] | None) -> Tensors:
    """The language model as Qwen2VLModel writes it; returns what each tensor decodes to, by checkpoint name."""
    cfg = json.loads((ckpt / "config.json").read_text())["text_config"]
    w = gguf_writer(path, "qwen2vl", cfg)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    if sections is not None:
        w.add_rope_dimension_sections(sections)
    w.add_file_type(0 if outtype == "f32" else 1)
    add_word_vocab(w, TOKENS, [3 if t.startswith("<") else 1 for t in TOKENS])
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2VL, cfg["num_hidden_layers"])
    decoded = {}
    for ckpt_name, t in weights.items():
        name = ckpt_name.replace("model.language_model.", "model.")
        if not name.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")):
            continue
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        data = stored(new, t, outtype)
        w.add_tensor(new, data)
        decoded[ckpt_name] = data.astype(np.float32)
    close_gguf(w)
    return decoded


def _write_mmproj(
    path: Path, ckpt: Path, weights: Tensors, outtype: str, projector_type: str = "qwen2.5vl_merger", drop: str = ""
) -> Tensors:
    """The tower and merger as MmprojModel and Qwen2VLVisionModel write them (less the tensor `drop`);
    returns what each tensor decodes to, by checkpoint name."""
    cfg = json.loads((ckpt / "config.json").read_text())
    v = cfg["vision_config"]
    w = mmproj_writer(
        path,
        outtype,
        projector_type,
        v,
        projection_dim=cfg["text_config"]["hidden_size"],
        image_size=560,  # the converter's default: Qwen's config has none
        blocks=v["depth"],
        heads=v["num_heads"],
        mean=list(CLIP_MEAN),
        std=list(CLIP_STD),
        eps=cfg["text_config"]["rms_norm_eps"],
    )
    w.add_vision_use_silu(True)
    w.add_vision_n_wa_pattern(v["fullatt_block_indexes"][0] + 1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(v["depth"], 3))  # mm.2 numbered as a block
    decoded = {}
    for ckpt_name, t in weights.items():
        name = ckpt_name.replace("model.visual.", "visual.")
        if not name.startswith("visual."):
            continue
        if ".qkv." in name:
            split = zip("qkv", np.split(t, 3, axis=0))
            parts = [(names.get_name(name.replace("qkv", x), try_suffixes=(".weight", ".bias")), p) for x, p in split]
        elif "patch_embed.proj.weight" in name:
            patch = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH] + ".weight"
            parts = [(patch, t[:, :, 0]), (patch + ".1", t[:, :, 1])]
        else:
            parts = [(names.get_name(name, try_suffixes=(".weight", ".bias")), t)]
        values = []
        for new, part in parts:
            assert new is not None, name
            data = stored(new, np.ascontiguousarray(part), outtype)
            if new != drop:
                w.add_tensor(new, data)
            values.append(data.astype(np.float32))
        joined = np.stack(values, axis=2) if "patch_embed" in name else np.concatenate(values, axis=0)
        decoded[ckpt_name] = joined
    close_gguf(w)
    return decoded


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return Path(make_qwen25_vl(tmp_path_factory.mktemp("qwen25vl-gguf") / "hf", **GGUF_COMPATIBLE))


@pytest.fixture(scope="module", params=["f32", "f16"])
def pair(request, hf, tmp_path_factory) -> tuple[str, str, str]:
    """(text GGUF, mmproj GGUF, the twin checkpoint holding what they decode to) for one outtype."""
    outtype = request.param
    return gguf_pair(
        tmp_path_factory.mktemp(f"qwen-gguf-{outtype}"),
        hf,
        "qwen2.5-vl-tiny",
        lambda path, weights: _write_text(path, hf, weights, outtype, [2, 3, 3, 0]),
        lambda path, weights: _write_mmproj(path, hf, weights, outtype),
    )


def test_config_equals_the_checkpoints(pair):
    text, mmproj, twin = pair
    files = load_model_files(LoadConfig(text, None, "auto", None, mmproj=mmproj))
    ref = load_model_files(LoadConfig(twin, None, "auto", None)).model_config
    assert files.model_config.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert files.model_config.vision == ref.vision
    assert files.model_config.mrope_section == ref.mrope_section == (2, 3, 3)
    images = files.model_info().image_processor  # float32 in the file, as the processor computes in
    assert images.keys() == {"image_mean", "image_std"}
    assert images["image_mean"] == pytest.approx(CLIP_MEAN, rel=1e-7) and images["image_std"] == pytest.approx(
        CLIP_STD, rel=1e-7
    )
    alone = load_model_files(LoadConfig(text, None, "auto", None, mmproj="none")).model_config
    assert alone.architecture == "Qwen2ForCausalLM" and alone.vision is None


def test_tower_equals_hf(pair):
    from ember.runner.model_build import build_model

    text, mmproj, twin = pair
    files = load_model_files(LoadConfig(text, None, "auto", None, mmproj=mmproj))
    ours = build_model(files, files.model_config, 128, torch.float32, torch.device("cpu"), 0)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(twin, dtype=torch.float32).eval()
    grids = [(1, 4, 4), (1, 6, 10), (1, 12, 8)]  # one window; windows cut at the edges
    patches = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14)
    with torch.no_grad():
        ref = model.model.visual(patches, grid_thw=torch.tensor(grids)).pooler_output
        torch.testing.assert_close(ours.embed_patches(patches, grids), ref, rtol=0, atol=1e-5)


def test_greedy_tokens_equal_safetensors_and_hf(pair):
    text, mmproj, twin = pair
    a, b = picture(1, BIG), picture(2, SMALL)
    prompts = [
        {"prompt_token_ids": ONE, "multi_modal_data": {"image": a}},
        {"prompt_token_ids": TWO, "multi_modal_data": {"image": [a, b]}},
        {"prompt_token_ids": [2, 40, 41, 42, 43]},
    ]
    outs = []
    for model, kwargs in ((text, {"mmproj": mmproj}), (twin, {})):
        llm = make_llm(model, max_model_len=128, **kwargs)
        outs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
        llm.llm_engine.shutdown()
    assert outs[0] == outs[1]
    expected = [
        hf_greedy(twin, ONE, [a], 6),
        hf_greedy(twin, TWO, [a, b], 6),
        hf_greedy(twin, [2, 40, 41, 42, 43], [], 6),
    ]
    assert outs[0] == expected
    llm = make_llm(text, max_model_len=128, mmproj="none")  # the language model alone: Qwen2
    alone = llm.generate([prompts[2]], GREEDY, use_tqdm=False)[0]
    llm.llm_engine.shutdown()
    assert list(alone.outputs[0].token_ids) == expected[2]


def test_errors(hf, pair, tmp_path):
    text, mmproj, _ = pair
    weights = load_file(hf / "model.safetensors")
    qwen2 = tmp_path / "mmproj-qwen2vl.gguf"
    _write_mmproj(qwen2, hf, weights, "f16", projector_type="qwen2vl_merger")
    with pytest.raises(ModelLoadError, match=r"projector_type 'qwen2vl_merger' is not supported \(supported: gemma3, "):
        load_model_files(LoadConfig(text, None, "auto", None, mmproj=str(qwen2)))
    no_sections = tmp_path / "no-sections.gguf"
    _write_text(no_sections, hf, weights, "f16", None)
    with pytest.raises(ModelLoadError, match="lacks 'qwen2vl.rope.dimension_sections'"):
        load_model_files(LoadConfig(str(no_sections), None, "auto", None, mmproj=mmproj))
    bad = tmp_path / "bad-sections.gguf"
    _write_text(bad, hf, weights, "f16", [2, 3, 4, 0])
    with pytest.raises(ModelLoadError, match=r"dimension_sections \[2, 3, 4, 0\]: expected three sections"):
        load_model_files(LoadConfig(str(bad), None, "auto", None, mmproj="none"))
    one_frame = tmp_path / "mmproj-one-frame.gguf"
    _write_mmproj(one_frame, hf, weights, "f16", drop="v.patch_embd.weight.1")
    with pytest.raises(ModelLoadError, match="patch_embed.proj.weight is split in 2 tensors, but the file holds 1"):
        load_model_files(LoadConfig(text, None, "auto", None, mmproj=str(one_frame)))
