"""The front end's side of a prompt's images (Gemma 3): each image resized and normalized as the model's
image processor does (transformers' Gemma3ImageProcessor: resize to the tower's square side with
Pillow's bilinear filter, x / 255, then (x - mean) / std per channel), and the prompt's placeholders
expanded into the image tokens the language model reads. Pillow and numpy only: no torch here.
Qwen2.5-VL's images, of any size, are ember/multimodal/qwen2_vl.py's; `image_processor` picks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
from PIL import Image

from ember.multimodal.inputs import QWEN25_VL_FAMILY, ImageInput, VisionFacts
from ember.multimodal.media import to_rgb
from ember.multimodal.normalize import byte_table, normalized
from ember.multimodal.qwen2_vl import RESAMPLE, QwenImageProcessor
from ember.tokenizer import Tokenizer


@dataclass(frozen=True)
class ImageProcessor:
    """`preprocessor_config.json`'s resize filter, mean and std (Gemma 3's defaults where it has none)."""

    vision: VisionFacts
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resample: int = 2

    @classmethod
    def of(cls, vision: VisionFacts, config: dict[str, Any]) -> ImageProcessor:
        resample = int(config.get("resample", 2))
        if resample not in RESAMPLE:
            raise ValueError(f"preprocessor_config.json: resample {resample} is not supported ({sorted(RESAMPLE)})")
        return cls(
            vision,
            tuple(config.get("image_mean", cls.mean)),
            tuple(config.get("image_std", cls.std)),
            float(config.get("rescale_factor", cls.rescale)),
            resample,
        )

    def pixels(self, image: Image.Image) -> np.ndarray:
        """float32 [3, size, size]: the image as the vision tower reads it (transparency over white, as
        transformers' `convert_to_rgb`)."""
        size = self.vision.image_size
        rgb = to_rgb(image).resize((size, size), RESAMPLE[self.resample])
        return normalized(np.ascontiguousarray(np.asarray(rgb).transpose(2, 0, 1)), self.table, axis=0)

    @cached_property
    def table(self) -> np.ndarray:
        """as transformers: the resized uint8 image rescaled in float32, then normalized per channel"""
        return byte_table(self.rescale, self.mean, self.std)

    def expand_ids(self, ids: list[int], images: list[Image.Image], tokenizer: Tokenizer | None) -> list[int]:
        """Token ids with each placeholder (`boi_token_id`) replaced by an image's tokens as Gemma 3's
        processor writes them: `\\n\\n` boi image*N eoi `\\n\\n` (`\\n\\n` as the tokenizer writes it)."""
        v = self.vision
        newline_ids = tokenizer.encode("\n\n", add_special_tokens=False) if tokenizer is not None else []
        out: list[int] = []
        for t in ids:
            if t != v.boi_token_id:
                out.append(t)
                continue
            out += [*newline_ids, t, *[v.image_token_id] * v.tokens_per_image, v.eoi_token_id, *newline_ids]
        return out

    def expand_text(self, text: str, images: list[Image.Image], tokenizer: Tokenizer) -> str:
        """The same in text, before tokenizing (as the processor does: `\\n\\n` then merges with the text
        around it as the tokenizer decides)."""
        v = self.vision
        boi, image, eoi = (tokenizer.id_to_token(t) or "" for t in (v.boi_token_id, v.image_token_id, v.eoi_token_id))
        return text.replace(boi, f"\n\n{boi}{image * v.tokens_per_image}{eoi}\n\n")

    def inputs(self, ids: list[int], images: list[Image.Image]) -> list[ImageInput]:
        """The images as the engine takes them, paired in order with the expanded prompt's runs of image
        tokens; a ValueError naming the field when they do not pair."""
        v = self.vision
        runs = [i for i, t in enumerate(ids) if t == v.image_token_id and (i == 0 or ids[i - 1] != t)]
        whole = all(ids[i : i + v.tokens_per_image] == [v.image_token_id] * v.tokens_per_image for i in runs)
        if len(runs) != len(images) or not whole:
            raise ValueError(
                f"multi_modal_data: {len(images)} image(s) for {len(runs)} image placeholder(s) in the prompt; "
                f"put one placeholder (token {v.boi_token_id}) where each image goes"
            )
        out = []
        for offset, image in zip(runs, images):
            pixels = self.pixels(image).tobytes()
            key = hashlib.sha256(pixels).hexdigest()
            out.append(ImageInput(offset, v.tokens_per_image, key, v.image_size, pixels))
        return out


def image_processor(vision: VisionFacts, config: dict[str, Any]) -> ImageProcessor | QwenImageProcessor:
    """The model's image processor from `preprocessor_config.json`: Gemma 3's fixed-size images, or
    Qwen2.5-VL's of any size (ember/multimodal/qwen2_vl.py)."""
    if vision.family == QWEN25_VL_FAMILY:
        return QwenImageProcessor.of(vision, config)
    return ImageProcessor.of(vision, config)
