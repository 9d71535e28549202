"""Qwen2.5-VL (docs/multimodal.md): a tiny random Qwen2_5_VLForConditionalGeneration checkpoint made here, against
HF transformers on the same weights and pixels (float32, CPU).

Covers the image processor (smart_resize, bicubic, CLIP normalization, the patch layout, the grid) against
transformers' Qwen2VLImageProcessorPil, the vision tower (window attention in one block, full attention in
the other, 2D rotary, the merger) against its `visual`, the M-RoPE positions against `get_rope_index`,
and greedy tokens against `generate`: one image, two images of different sizes, chunked prefill, the
prefix cache hit with the same image (its tower run once), text alone, and a text prompt whose
`<|image_pad|>` the front end expands. Image scheduling (docs/multimodal.md): a chunk ending inside
an image (its tower run once, its output pinned until the request is done with it), a request aborted
or preempted in the middle of an image (pins released, the output reused), and the encoder budget
delaying a second image to a later step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from qwen_vl_fixtures import (
    END,
    MIN_PIXELS,
    PAD,
    START,
    hf_greedy,
    hf_inputs,
    make_llm,
    make_qwen25_vl,
    picture,
    processor,
)

from ember import LLM, SamplingParams


@pytest.fixture(scope="module")
def qwen25vl(tmp_path_factory) -> str:
    return make_qwen25_vl(tmp_path_factory.mktemp("qwen25vl") / "m")


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SQUARE, WIDE, RESIZED = (56, 56), (28, 84), (100, 70)  # patch grids 4 x 4, 2 x 6, 4 x 8 (resized to 56 x 112)
ONE = [2, 10, 11, START, PAD, END, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
TWO = [2, 30, START, PAD, END, 31, 32, START, PAD, END, 33, 34]


def test_image_processor_equals_hf(qwen25vl):
    from ember.multimodal.preprocess import image_processor
    from ember.multimodal.qwen2_vl import QwenImageProcessor

    llm = make_llm(qwen25vl, max_model_len=128)
    ours = llm.llm_engine.processor.images
    assert isinstance(ours, QwenImageProcessor) and ours.min_pixels == MIN_PIXELS
    assert image_processor(ours.vision, {"min_pixels": 56 * 56}).min_pixels == 56 * 56
    llm.llm_engine.shutdown()
    for seed, size in enumerate([SQUARE, WIDE, RESIZED, (300, 500)]):  # the last: scaled down to max_pixels
        image = picture(seed, size)
        ref = processor()([image], return_tensors="np")
        patches, grid = ours.patches(image)
        assert grid == tuple(ref["image_grid_thw"][0].tolist())
        np.testing.assert_allclose(patches, ref["pixel_values"], rtol=0, atol=1e-6)
        assert ours.length(image) == int(np.prod(grid)) // 4


def test_tower_equals_hf(qwen25vl):
    from ember.config import LoadConfig
    from ember.model.loader import load_model_files
    from ember.runner.model_build import build_model

    files = load_model_files(LoadConfig(qwen25vl, None, "auto", None))
    ours = build_model(files, files.model_config, 128, torch.float32, torch.device("cpu"), 0)
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen25vl, dtype=torch.float32).eval()
    grids = [(1, 4, 4), (1, 2, 6), (1, 8, 10)]  # one window; two; windows cut at the edges
    patches = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14)
    with torch.no_grad():
        ref = hf.model.visual(patches, grid_thw=torch.tensor(grids)).pooler_output
        torch.testing.assert_close(ours.embed_patches(patches, grids), ref, rtol=0, atol=1e-5)


def test_mrope_positions_equal_hf_rope_index(qwen25vl):
    from ember.multimodal.inputs import ImageInput
    from ember.multimodal.mrope import mrope_delta, mrope_positions

    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen25vl, dtype=torch.float32).eval()
    images = [picture(1, WIDE), picture(2, RESIZED)]
    inputs = hf_inputs(TWO, images)
    ref, delta = hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    ids = inputs["input_ids"][0].tolist()
    runs = [i for i, t in enumerate(ids) if t == PAD and ids[i - 1] != PAD]
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    ours = [ImageInput(r, int(np.prod(g)) // 4, "", 0, b"", g) for r, g in zip(runs, grids)]
    assert np.array_equal(mrope_positions(ours, 2, 0, len(ids)), ref[:, 0].numpy())
    assert np.array_equal(mrope_positions(ours, 2, 5, 17), ref[:, 0, 5:17].numpy())  # a chunk
    assert mrope_delta(ours, 2) == int(delta)


@pytest.mark.parametrize("budget", [None, 6])  # 6: chunks [0, 6), [6, 12), ... cut the image (tokens 4-7)
def test_one_image_greedy_equals_hf(qwen25vl, budget):
    llm = make_llm(qwen25vl, max_num_batched_tokens=budget, max_model_len=128)
    image = picture(1, SQUARE)
    out = llm.generate({"prompt_token_ids": ONE, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids[3:9] == [START, PAD, PAD, PAD, PAD, END]
    assert list(out.outputs[0].token_ids) == hf_greedy(qwen25vl, ONE, [image], 6)
    llm.llm_engine.shutdown()


def test_two_images_of_different_sizes_and_the_prefix_cache(qwen25vl):
    llm = make_llm(qwen25vl, max_model_len=128)
    a, b = picture(2, WIDE), picture(3, RESIZED)
    two = llm.generate({"prompt_token_ids": TWO, "multi_modal_data": {"image": [a, b]}}, GREEDY, use_tqdm=False)[0]
    assert len(two.prompt_token_ids) == len(TWO) - 2 + 3 + 8
    assert list(two.outputs[0].token_ids) == hf_greedy(qwen25vl, TWO, [a, b], 6)
    image = picture(4, SQUARE)
    first = llm.generate({"prompt_token_ids": ONE, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": ONE, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 16  # its first block, the image in it
    assert llm.llm_engine.scheduler_stats().num_encoded_images == 3  # `again` ran no tower
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids) == hf_greedy(qwen25vl, ONE, [image], 6)
    llm.llm_engine.shutdown()


def test_text_alone_and_a_text_prompt(qwen25vl):
    llm = make_llm(qwen25vl, max_model_len=128)
    ids = [2, 40, 41, 42, 43, 44, 45]
    out = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(qwen25vl, ids, [], 6)
    image = picture(5, WIDE)
    prompt = "w0 w8 <|vision_start|><|image_pad|><|vision_end|> w9 w10"
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    expected = [2, 10, START, PAD, PAD, PAD, END, 11, 12]
    assert out.prompt_token_ids == expected
    assert list(out.outputs[0].token_ids) == hf_greedy(qwen25vl, [2, 10, START, PAD, END, 11, 12], [image], 6)
    with pytest.raises(ValueError, match=r"2 image\(s\) for 1 image placeholder"):
        llm.generate({"prompt_token_ids": ONE, "multi_modal_data": {"image": [image, image]}}, GREEDY)
    llm.llm_engine.shutdown()


ONE_LONG = [2, 10, 11, START, PAD, END, 12, 13, 14, 15]  # with a RESIZED image: its 8 tokens at [4, 12)


def _run(llm: LLM, prompts: dict[str, dict], params: dict[str, SamplingParams] | None = None, abort_when_pinned=""):
    """Add the prompts by id (GREEDY, or their `params`) and step until all end: their tokens, and the stats
    after each step. `abort_when_pinned`: abort that request after the first step that leaves an image pinned."""
    engine = llm.llm_engine
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, (params or {}).get(rid, GREEDY))
    tokens, trace = {}, []
    while engine.has_unfinished_requests():
        tokens |= {o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished}
        trace.append(engine.scheduler_stats())
        if abort_when_pinned in engine.output_processor.requests and trace[-1].num_pinned_images:
            engine.abort_request(abort_when_pinned)
    return tokens, trace


def test_a_chunk_ends_inside_an_image_and_an_abort_releases_it(qwen25vl):
    # 4 tokens a step cut the 8-token image in two; it is longer than the encoder budget (4, the step's
    # tokens), so the tower runs for it alone, once
    llm = make_llm(qwen25vl, max_num_batched_tokens=4, max_model_len=64, enable_prefix_caching=False)
    image = picture(1, RESIZED)
    prompt = {"prompt_token_ids": ONE_LONG, "multi_modal_data": {"image": image}}
    expected = hf_greedy(qwen25vl, ONE_LONG, [image], 6)
    tokens, trace = _run(llm, {"a": prompt})
    assert tokens["a"] == expected
    assert [s.num_pinned_images for s in trace[:3]] == [0, 1, 0]  # chunks [0, 4), [4, 8), [8, 12): pinned between
    assert trace[-1].num_encoded_images == 1

    # aborted in the middle of the image: the next step releases its pin; the output stays cached
    tokens, trace = _run(llm, {"b": prompt}, abort_when_pinned="b")
    assert "b" not in tokens and trace[-1].num_pinned_images == 1  # no step since the abort
    tokens, trace = _run(llm, {"c": {"prompt_token_ids": [2, 40, 41]}, "d": prompt})
    assert tokens["d"] == expected and trace[0].num_pinned_images == 0
    assert trace[-1].num_encoded_images == 1  # `b` and `d` found it cached
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_preempted_in_the_middle_of_an_image(qwen25vl, async_scheduling):
    # 8 blocks of 4 tokens: `text` decoding and `image` prefilling 4 tokens a step outgrow them, and the
    # newest running request, `image`, is preempted, in the middle of its image among other times
    llm = make_llm(
        qwen25vl,
        max_num_batched_tokens=4,
        block_size=4,
        kv_cache_memory=8 * 2048 / 2**30,  # K and V, 2 layers, 4 tokens, 2 heads of 16, float32
        max_model_len=32,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    assert llm.llm_engine.ready.num_blocks == 8
    image = picture(1, RESIZED)
    prompts = {
        "text": {"prompt_token_ids": [2, 40, 41]},
        "image": {"prompt_token_ids": ONE_LONG, "multi_modal_data": {"image": image}},
    }
    tokens, trace = _run(llm, prompts, {"text": SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)})
    preempted_while_pinned = [
        a.num_pinned_images and b.num_preemptions > a.num_preemptions for a, b in zip(trace, trace[1:])
    ]
    assert any(preempted_while_pinned)
    assert tokens["image"] == hf_greedy(qwen25vl, ONE_LONG, [image], 6)
    assert trace[-1].num_pinned_images == 0 and trace[-1].num_encoded_images == 1  # reused after each preemption
    llm.llm_engine.shutdown()


def test_the_encoder_budget_delays_the_second_image_to_a_later_step(qwen25vl):
    a, b = picture(2, WIDE), picture(3, RESIZED)  # 3 and 8 image tokens
    prompt = {"prompt_token_ids": TWO, "multi_modal_data": {"image": [a, b]}}
    expected = hf_greedy(qwen25vl, TWO, [a, b], 6)
    steps = []
    for encoder_budget in (None, 8):
        llm = make_llm(qwen25vl, max_model_len=128, max_num_encoder_input_tokens=encoder_budget)
        tokens, trace = _run(llm, {"r": prompt})
        assert tokens["r"] == expected and trace[-1].num_encoded_images == 2
        steps.append(trace[-1].num_steps)
        llm.llm_engine.shutdown()
    assert steps == [6, 7]  # the prompt in one step, or up to the second image and then the rest


def test_vision_benchmark_runs_on_a_tiny_model(qwen25vl, tmp_path):
    """benchmarks/vision.py end to end on the CPU (its GPU run is the Qwen2.5-VL-7B shape): both runs do the whole
    workload, the text-only twin has the image run's prompt lengths, and the tower is timed per batch."""
    out = tmp_path / "v.json"
    flags = "--device cpu --load-format auto --num-prompts 3 --output-len 4 --image-size 56 --text-len 8"
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "benchmarks/vision.py", "--model", qwen25vl, *flags.split(), "--out", str(out)]
    r = subprocess.run([*cmd, "--encoder-batches", "1", "2"], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    images, texts = res["with_images"], res["text_only"]
    assert images["output_tokens"] == texts["output_tokens"] == 3 * 4
    assert images["prompt_tokens"] == texts["prompt_tokens"] == 3 * (8 + 2 + 4)  # 56 x 56: 4 merged image tokens
    assert set(res["tower_ms_per_image"]) == {"1", "2"} and min(res["tower_ms_per_image"].values()) > 0
    assert res["ratio"] == round(images["output_tok_per_s"] / texts["output_tok_per_s"], 3)
