"""M-RoPE positions (Qwen2.5-VL): each token's (temporal, height, width) rotary positions, from the prompt's
images alone, as transformers' `Qwen2_5_VLModel.get_rope_index` gives them.

Text tokens take one position for all three, counting on from the token before. An image's tokens
(its merged grid t x h x w, row-major) take (s + frame, s + row, s + column) where s is the position the
next text token would have had; the text after it goes on from s + max(h, w). So a token at prompt
index i outside every image sits at i + `shift`, the shift the images before it left, and every token
after the prompt (decoding) at its index + the prompt's last shift (`mrope_delta`, transformers'
rope_deltas). Computed per chunk from the images' offsets and grids: nothing per prompt token is kept
or sent. numpy only.
"""

from __future__ import annotations

import numpy as np

from ember.multimodal.inputs import ImageInput


def mrope_positions(images: list[ImageInput], merge: int, start: int, end: int) -> np.ndarray:
    """int64 [3, end - start]: the positions of prompt (or later) indices [start, end)."""
    idx = np.arange(start, end, dtype=np.int64)
    out = np.empty((3, end - start), dtype=np.int64)
    shift, text_from = 0, 0
    for image in images:
        text = (idx >= text_from) & (idx < image.offset)
        out[:, text] = idx[text] + shift
        t, h, w = _merged(image, merge)
        base = image.offset + shift
        inside = (idx >= image.offset) & (idx < image.end)
        k = idx[inside] - image.offset
        out[0, inside] = base + k // (h * w)
        out[1, inside] = base + k // w % h
        out[2, inside] = base + k % w
        shift, text_from = base + max(h, w) - image.end, image.end
    text = idx >= text_from
    out[:, text] = idx[text] + shift
    return out


def mrope_delta(images: list[ImageInput], merge: int) -> int:
    """Position minus index of every token after the last image (the decoded ones among them)."""
    shift = 0
    for image in images:
        _, h, w = _merged(image, merge)
        shift += max(h, w) - image.length
    return shift


def _merged(image: ImageInput, merge: int) -> tuple[int, int, int]:
    """The image's token grid: its patch grid with rows and columns merged."""
    assert image.grid is not None, "M-RoPE positions need the images' patch grids"
    t, h, w = image.grid
    return t, h // merge, w // merge
