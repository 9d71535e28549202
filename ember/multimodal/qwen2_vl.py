"""The front end's side of Qwen2.5-VL's images, as transformers' Qwen2VLImageProcessorPil computes them:
each image resized (Pillow's bicubic) to the `smart_resize` size (sides multiples of patch_size *
merge_size, its pixels within [min_pixels, max_pixels], the aspect kept as near as may be), x / 255 in
float32, normalized by the CLIP mean and std, then cut into patch_size patches laid out so that each
merge group's patches are adjacent, each patch repeated over `temporal_patch_size` frames (a still
image), flattened to [grid_h * grid_w, 3 * temporal_patch_size * patch_size^2] with grid (1, h, w).
Each placeholder `<|image_pad|>` becomes grid_h * grid_w / merge^2 of them. Pillow and numpy only.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
from PIL import Image

from ember.multimodal.inputs import ImageInput, VisionFacts
from ember.multimodal.media import to_rgb
from ember.multimodal.normalize import byte_table, normalized
from ember.tokenizer import Tokenizer

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESAMPLE = {0: Image.Resampling.NEAREST, 2: Image.Resampling.BILINEAR, 3: Image.Resampling.BICUBIC}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' qwen2_vl smart_resize: (height, width) rounded to multiples of `factor`, scaled into
    [min_pixels, max_pixels] keeping the aspect ratio."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"multi_modal_data.image: aspect ratio {max(height, width) / min(height, width):.0f} > 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class QwenImageProcessor:
    """`preprocessor_config.json`'s sizes, filter, mean and std (transformers' defaults where it has none)."""

    vision: VisionFacts
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    rescale: float = 1 / 255
    resample: int = 3

    @classmethod
    def of(cls, vision: VisionFacts, config: dict[str, Any]) -> QwenImageProcessor:
        size = config.get("size") or {}
        for key, value in (("patch_size", vision.patch_size), ("merge_size", vision.merge_size)):
            if config.get(key, value) != value:
                raise ValueError(f"preprocessor_config.json: {key} {config[key]} differs from the model's {value}")
        resample = int(config.get("resample", 3))
        if resample not in RESAMPLE:
            raise ValueError(f"preprocessor_config.json: resample {resample} is not supported ({sorted(RESAMPLE)})")
        return cls(
            vision,
            int(config.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels),
            int(config.get("max_pixels") or size.get("longest_edge") or cls.max_pixels),
            tuple(config.get("image_mean", cls.mean)),
            tuple(config.get("image_std", cls.std)),
            float(config.get("rescale_factor", cls.rescale)),
            resample,
        )

    def resized(self, image: Image.Image) -> tuple[int, int]:
        """(height, width) the image is resized to."""
        v = self.vision
        return smart_resize(image.height, image.width, v.patch_size * v.merge_size, self.min_pixels, self.max_pixels)

    def length(self, image: Image.Image) -> int:
        """The image's tokens in the prompt."""
        h, w = self.resized(image)
        return h * w // (self.vision.patch_size * self.vision.merge_size) ** 2

    def patches(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """float32 [h * w, 3 * temporal * patch^2] flattened patches and the patch grid (1, h, w)."""
        v = self.vision
        height, width = self.resized(image)
        rgb = np.asarray(to_rgb(image).resize((width, height), RESAMPLE[self.resample])).transpose(2, 0, 1)
        p, m = v.patch_size, v.merge_size
        gh, gw = height // p, width // p
        # the bytes cut into patches first (a quarter of float32's bytes to move), then looked up
        u = rgb.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # groups, group rows/cols, c
        x = normalized(np.ascontiguousarray(u).reshape(gh * gw, 3, 1, p * p), self.table, axis=1)
        frames = np.broadcast_to(x, (gh * gw, 3, v.temporal_patch_size, p * p))
        return np.ascontiguousarray(frames).reshape(gh * gw, -1), (1, gh, gw)

    @cached_property
    def table(self) -> np.ndarray:
        return byte_table(self.rescale, self.mean, self.std)

    def expand_ids(self, ids: list[int], images: list[Image.Image], tokenizer: Tokenizer | None) -> list[int]:
        """Token ids with the i-th placeholder (`image_token_id`) repeated for image i's tokens."""
        pad = self.vision.image_token_id
        self._check_count(sum(t == pad for t in ids), images)
        lengths = iter(self.length(im) for im in images)
        return [x for t in ids for x in ([t] * next(lengths) if t == pad else [t])]

    def expand_text(self, text: str, images: list[Image.Image], tokenizer: Tokenizer) -> str:
        """The same in text, before tokenizing (as Qwen2_5_VLProcessor does)."""
        pad = tokenizer.id_to_token(self.vision.image_token_id) or "<|image_pad|>"
        parts = text.split(pad)
        self._check_count(len(parts) - 1, images)
        return parts[0] + "".join(pad * self.length(im) + part for im, part in zip(images, parts[1:]))

    def inputs(self, ids: list[int], images: list[Image.Image]) -> list[ImageInput]:
        """The images as the engine takes them, paired in order with the expanded prompt's runs of image
        tokens; a ValueError naming the field when they do not pair."""
        pad = self.vision.image_token_id
        runs = [i for i, t in enumerate(ids) if t == pad and (i == 0 or ids[i - 1] != t)]
        if len(runs) != len(images):
            self._check_count(len(runs), images)
        out = []
        for offset, image in zip(runs, images):
            n = self.length(image)
            if ids[offset : offset + n] != [pad] * n or ids[offset + n : offset + n + 1] == [pad]:
                raise ValueError(f"multi_modal_data: an image's {n} tokens do not match its placeholder's run")
            patches, grid = self.patches(image)
            pixels = patches.tobytes()
            key = hashlib.sha256(pixels + np.asarray(grid, dtype=np.int64).tobytes()).hexdigest()  # the shape too
            out.append(ImageInput(offset, n, key, 0, pixels, grid))
        return out

    def _check_count(self, placeholders: int, images: list[Image.Image]) -> None:
        if placeholders != len(images):
            raise ValueError(
                f"multi_modal_data: {len(images)} image(s) for {placeholders} image placeholder(s) in the prompt; "
                f"put one placeholder (token {self.vision.image_token_id}, <|image_pad|>) where each image goes"
            )
