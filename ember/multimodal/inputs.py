"""A prompt's images as the engine carries them: what the front end sends (`ImageInput`, preprocessed
pixels and where the image's tokens sit) and what the core tells the front end about the model's vision
(`VisionFacts`). No torch: the front end, the messages and the core import these.
"""

from __future__ import annotations

import msgspec

QWEN25_VL_FAMILY = "qwen2_5_vl"  # VisionFacts.family of Qwen2.5-VL (the default, "gemma3": Gemma 3's)


class ImageInput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One image of a prompt. `offset`, `length`: its image tokens' prompt positions (the front end wrote
    them in place of the model's placeholder); `key`: its content hash, which keys the prefix cache's
    blocks over those tokens (the tokens are the same for every image) and the runner's cache of
    vision-tower outputs; `pixels`: float32 [3, size, size] in C order, preprocessed as the model's
    image processor does. Qwen2.5-VL's images come in any size: `grid` is then the image's patch grid
    (frames, rows, columns; `length` = their product / merge^2), `pixels` float32 [t * h * w, 3 *
    temporal_patch_size * patch_size^2] (the flattened patches), and `size` 0."""

    offset: int
    length: int
    key: str
    size: int
    pixels: bytes
    grid: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


class VisionFacts(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What a front end needs of a vision model, sent in `EngineCoreReady`: the placeholder a prompt holds
    for each image (`boi_token_id`, Gemma 3's "<start_of_image>"), what it expands to (`\\n\\n`, boi,
    `tokens_per_image` x `image_token_id`, `eoi_token_id`, `\\n\\n`), and the images' side in pixels.

    Qwen2.5-VL (`family` "qwen2_5_vl"): the placeholder is one `image_token_id` ("<|image_pad|>", between
    `boi_token_id` "<|vision_start|>" and `eoi_token_id` "<|vision_end|>", which the prompt holds), which
    becomes as many as the image's merged patches; `tokens_per_image` and `image_size` are 0, and the
    patch sizes say how an image is cut."""

    tokens_per_image: int
    image_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    family: str = "gemma3"
    patch_size: int = 0
    temporal_patch_size: int = 0
    merge_size: int = 0


def images_in(images: list[ImageInput], start: int, end: int) -> list[ImageInput]:
    """The images with a token in positions [start, end)."""
    return [im for im in images if im.offset < end and im.end > start]


def chunk_end(images: list[ImageInput], start: int, end: int) -> int:
    """Where a prefill chunk over [start, end) may end so that it splits no image, for a model whose image
    tokens attend to each other both ways (Gemma 3; ember/core/encoder_budget.py): one chunk holds all
    of an image's tokens it computes. `end` when no image straddles it; else the image's start, or, when
    the chunk starts inside that image (a prefix-cache hit may end there), its end (which may be past
    `end`: the caller checks its budget)."""
    for im in images:
        if im.offset < end < im.end:
            return im.offset if im.offset > start else im.end
    return end
