"""What the Qwen2.5-VL tests share (tests/test_qwen25_vl.py, tests/test_gguf_mmproj_qwen.py): a tiny random
Qwen2_5_VLForConditionalGeneration checkpoint with a word-level tokenizer, pictures, and HF transformers'
greedy tokens for a prompt with images (float32, CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from conftest import DEVICE
from PIL import Image

from ember import LLM

VOCAB = 400
START, END, PAD = 395, 396, 397  # <|vision_start|>, <|vision_end|>, <|image_pad|>
MIN_PIXELS = 28 * 28  # so that a 28 x 84 image keeps its size: patch grid 2 x 6
WORDS = ["<pad>", "<eos>", *(f"w{i}" for i in range(START - 2))]


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    vocab = {t: i for i, t in enumerate([*WORDS, *specials])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(" "), behavior="removed")
    tok.add_special_tokens([*specials, "<eos>"])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def processor() -> transformers.Qwen2VLImageProcessorPil:
    return transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": 28 * 28 * 64})


def make_qwen25_vl(path: Path, **vision_overrides) -> str:
    """A Qwen2_5_VLForConditionalGeneration checkpoint with random weights, its tokenizer and image processor
    at path; vision_overrides change its vision_config."""
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        eos_token_id=1,
        bos_token_id=None,
        initializer_range=0.2,  # sharp attention, so that every position counts
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        window_size=56,  # 2 x 2 merged tokens a window
        fullatt_block_indexes=[1],
        patch_size=14,
        spatial_merge_size=2,
    )
    config = transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config={**vision, **vision_overrides},
        image_token_id=PAD,
        vision_start_token_id=START,
        vision_end_token_id=END,
        video_token_id=398,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    for name, p in model.named_parameters():  # norms away from the identity, so that every one counts
        if ("norm" in name and name.endswith("weight")) or "ln_q" in name:
            p.data.normal_(1.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer().save_pretrained(path)
    processor().save_pretrained(path)
    return str(path)


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    """A random RGB image of (width, height)."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def hf_inputs(ids: list[int], images: list[Image.Image]) -> dict[str, torch.Tensor]:
    """The prompt with each <|image_pad|> expanded as Qwen2_5_VLProcessor does, and its images' features."""
    kwargs: dict[str, torch.Tensor] = {}
    lengths = iter([])
    if images:
        out = processor()(images, return_tensors="np")
        kwargs["pixel_values"] = torch.from_numpy(np.asarray(out["pixel_values"]))
        kwargs["image_grid_thw"] = grid = torch.from_numpy(np.asarray(out["image_grid_thw"]))
        lengths = iter((grid.prod(-1) // 4).tolist())
    expanded = [x for t in ids for x in ([t] * next(lengths) if t == PAD else [t])]
    x = torch.tensor([expanded])
    return {"input_ids": x, "attention_mask": torch.ones_like(x), "mm_token_type_ids": (x == PAD).int(), **kwargs}


def hf_greedy(path: str, ids: list[int], images: list[Image.Image], n: int) -> list[int]:
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    inputs = hf_inputs(ids, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def make_llm(path: str, **kwargs) -> LLM:
    return LLM(
        path, **{"device": DEVICE, "dtype": "float32", "kv_cache_memory": 0.01, "engine_process": False, **kwargs}
    )
