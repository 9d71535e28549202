"""What the image tests share (tests/test_vision.py, tests/test_gguf_mmproj.py): a tiny random Gemma 3
vision-language checkpoint with a word-level tokenizer, pictures, HF transformers' greedy tokens for a prompt
with images (Gemma3ForConditionalGeneration, float32, CPU), and an LLM on the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from conftest import DEVICE
from PIL import Image

from ember import LLM

BOI, EOI, IMG = 297, 298, 299
TOKENS_PER_IMAGE = 4
WORDS = ["<pad>", "<eos>", "<bos>", "\n\n", *(f"w{i}" for i in range(BOI - 4))]
IMAGE_SIZE = 28
# SiglipVisionConfig: 28-pixel images of 7-pixel patches, a 4 x 4 grid pooled to 2 x 2 image tokens
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=IMAGE_SIZE,
    patch_size=7,
)
# What Gemma 3's template does with content parts, in brief: an image part is its `<start_of_image>`.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<start_of_image>{% else %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
)


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate([*WORDS, "<start_of_image>", "<end_of_image>", "<image_soft_token>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n\n| "), behavior="isolated")
    tok.add_special_tokens(["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<bos>", "<eos>"])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    fast.chat_template = GEMMA3_TEMPLATE
    return fast


def make_gemma3_vision(path: Path, **text_overrides) -> str:
    """A Gemma3ForConditionalGeneration checkpoint with random weights (norms away from the identity, so that
    every one counts) and its tokenizer at path; text_overrides change its text_config."""
    text = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=16,  # longer than an image (4 tokens), shorter than the prompts
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
    )
    config = transformers.Gemma3Config(
        text_config={**text, **text_overrides},
        vision_config={**VISION, "vision_use_head": False},
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMG,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith("weight"):
            p.data.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer().save_pretrained(path)
    return str(path)


def picture(seed: int, size: tuple[int, int] = (41, 33)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def hf_greedy(path: str, ids: list[int], images: list[Image.Image], n: int) -> list[int]:
    """HF generate on the prompt with each placeholder expanded as Gemma3Processor does."""
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    nl = WORDS.index("\n\n")
    expanded: list[int] = []
    for t in ids:
        expanded += [nl, BOI, *[IMG] * TOKENS_PER_IMAGE, EOI, nl] if t == BOI else [t]
    x = torch.tensor([expanded])
    kwargs = {}
    if images:
        proc = transformers.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        kwargs["pixel_values"] = torch.from_numpy(np.asarray(proc(images, return_tensors="np")["pixel_values"]))
        kwargs["token_type_ids"] = (x == IMG).long()
    with torch.no_grad():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs
        )
    return out[0, len(expanded) :].tolist()


def make_llm(path: str, **kwargs) -> LLM:
    return LLM(path, device=DEVICE, dtype="float32", kv_cache_memory=0.01, engine_process=False, **kwargs)
