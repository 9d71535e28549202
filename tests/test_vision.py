"""Images in prompts (docs/multimodal.md): a tiny random Gemma 3 vision-language checkpoint (tests/vision_fixtures.py),
greedy tokens against HF transformers' Gemma3ForConditionalGeneration on the same weights and pixels (float32, CPU).

Covers the vision tower and projector (equal to HF's image features), the placeholder's expansion into
the image tokens, Gemma 3's bidirectional attention among an image's tokens (full and sliding-window
layers), images never split by chunked prefill (never pinned half computed; one longer than a step's
tokens is refused), two images in one prompt, the prefix cache keyed by the
image (the same picture hits and skips the tower; another picture with the same tokens does not), and
the errors: a count of images that does not match the placeholders, images to a text-only model.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_checkpoint
from vision_fixtures import BOI, EOI, IMG, TOKENS_PER_IMAGE, hf_greedy, make_llm, picture

from ember import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [2, 10, 11, 12, BOI, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]  # past the 16-token window
TWO = [2, 30, BOI, 31, 32, BOI, 33, 34]


def test_image_features_equal_hf(gemma3):
    from ember.config import LoadConfig
    from ember.model.loader import load_model_files
    from ember.runner.model_build import build_model

    files = load_model_files(LoadConfig(gemma3, None, "auto", None))
    ours = build_model(files, files.model_config, 64, torch.float32, torch.device("cpu"), 0)
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(gemma3, dtype=torch.float32).eval()
    pixels = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        ref = hf.model.get_image_features(pixel_values=pixels)
        ref = getattr(ref, "pooler_output", ref)
        torch.testing.assert_close(ours.embed_images(pixels), ref.reshape(2, TOKENS_PER_IMAGE, -1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("budget", [None, 8])  # 8: chunks that would cut the image
def test_greedy_tokens_equal_hf(gemma3, budget):
    llm = make_llm(gemma3, max_num_batched_tokens=budget, max_model_len=64)
    image = picture(1)
    out = llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(gemma3, PROMPT, [image], 6)
    assert out.prompt_token_ids[5 : 5 + TOKENS_PER_IMAGE + 2] == [BOI, *[IMG] * TOKENS_PER_IMAGE, EOI]
    llm.llm_engine.shutdown()


def test_a_chunk_never_ends_inside_an_image(gemma3):
    # 8 tokens a step would cut the image at [6, 10); the chunks are [0, 6), [6, 14), ... instead, so no
    # step leaves it half computed (pinned in the runner's cache, as a split Qwen2.5-VL image is)
    llm = make_llm(gemma3, max_num_batched_tokens=8, max_model_len=64)
    engine, image = llm.llm_engine, picture(1)
    engine.add_request("r", {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": image}}, GREEDY)
    pinned = []
    while engine.has_unfinished_requests():
        tokens = [list(o.outputs[0].token_ids) for o in engine.step() if o.finished]
        pinned.append(engine.scheduler_stats().num_pinned_images)
    assert tokens == [hf_greedy(gemma3, PROMPT, [image], 6)] and pinned == [0] * len(pinned)
    engine.shutdown()
    small = make_llm(gemma3, max_num_batched_tokens=3, max_model_len=64)
    (out,) = small.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    assert out.error == "images: an image's 4 tokens exceed max_num_batched_tokens (3)"
    small.llm_engine.shutdown()


def test_two_images_and_the_prefix_cache_keyed_by_image(gemma3):
    llm = make_llm(gemma3, max_model_len=64)
    a, b = picture(2), picture(3, (20, 50))
    two = llm.generate({"prompt_token_ids": TWO, "multi_modal_data": {"image": [a, b]}}, GREEDY, use_tqdm=False)
    assert list(two[0].outputs[0].token_ids) == hf_greedy(gemma3, TWO, [a, b], 6)
    first = llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": a}}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": a}}, GREEDY, use_tqdm=False)[0]
    other = llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": b}}, GREEDY, use_tqdm=False)[0]
    # the same picture: its first block (positions 0-15, the image's tokens at 6-9) hits, so the image's
    # tokens are not computed again and the tower does not run for it
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 16
    assert other.num_cached_tokens == 0  # another picture, the same tokens: its block's key differs
    assert llm.llm_engine.scheduler_stats().num_encoded_images == 2  # a and b once each: `again` ran no tower
    assert list(other.outputs[0].token_ids) == hf_greedy(gemma3, PROMPT, [b], 6)
    llm.llm_engine.shutdown()


def test_image_errors(gemma3, tmp_path):
    llm = make_llm(gemma3, max_model_len=64)
    with pytest.raises(ValueError, match=r"2 image\(s\) for 1 image placeholder"):
        llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": [picture(1), picture(2)]}}, GREEDY)
    with pytest.raises(ValueError, match="only 'image' is supported"):
        llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": b""}}, GREEDY)
    llm.llm_engine.shutdown()
    text_only = make_llm(str(make_checkpoint(tmp_path / "llama", "llama")))
    with pytest.raises(ValueError, match="does not accept image input"):
        text_only.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": picture(1)}}, GREEDY)
    text_only.llm_engine.shutdown()
