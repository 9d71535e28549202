"""A step's images: the vision tower's output for each image token the step computes, and how far each of
those tokens attends.

The tower runs once for a whole image, in the step that first computes one of its tokens, and the step
takes the rows of it that it computes: all of them for Gemma 3, whose chunks never split an image, a
slice [lo, hi) where Qwen2.5-VL's chunk begins or ends inside one (ember/core/encoder_budget.py). The
outputs live in a cache keyed by the image's content hash (`ImageInput.key`), filled by one batched
tower call for the step's new images: a picture repeated in a conversation, or shared by requests, runs
through the tower once while it stays among the last `CACHE_IMAGES` used. A request that has computed
part of an image pins its output until it computes the rest, finishes, is aborted or is preempted (the
step descriptions' finished and preempted ids), so its next chunk never runs the tower again: pinned
outputs are never evicted (the cache outgrows `CACHE_IMAGES` only while more are pinned).

Gemma 3's image tokens attend to every token of their own image, so each image row's query limit
(`AttentionMetadata.query_limits`) is its image's last position; every other row's is its own position.
Qwen2.5-VL's attend causally (no limits); its images, each of its own patch grid, go through the tower
as one sequence of patches.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ember.model.llama import CausalLM, ImageRows
from ember.multimodal.inputs import ImageInput, images_in
from ember.runner.request_state import RequestState

# Images whose tower outputs stay on the device: 64 x 256 tokens x 2,560 x bf16 is 84 MB for Gemma-3-4B.
CACHE_IMAGES = 64


class StepImages:
    """The embeddings and query limits of a step's image tokens."""

    def __init__(self, model: CausalLM, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()  # key -> [tokens_per_image, hidden]
        self.pins: dict[str, set[str]] = {}  # request id -> keys of the images it has computed part of
        self.num_encoded = 0  # images run through the tower (a cache hit runs none)
        vision = model.config.vision
        self.bidirectional = vision is not None and vision.bidirectional_images

    @property
    def num_pinned(self) -> int:
        """Images whose outputs some request still needs the rest of."""
        return len(self._pinned())

    def _pinned(self) -> set[str]:
        return set().union(*self.pins.values())

    def release(self, request_ids: list[str]) -> None:
        """Unpin what finished, aborted or preempted requests held; the outputs stay cached for reuse (a
        preempted request's next chunk, another request's same picture) until evicted."""
        for request_id in request_ids:
            self.pins.pop(request_id, None)

    @staticmethod
    def in_step(requests: list[RequestState], num_new_tokens: list[int]) -> bool:
        """Whether any request computes an image token in the step (it then runs eagerly: no CUDA graph
        holds the embeddings' scatter or the limits)."""
        return any(
            images_in(r.images, r.num_computed_tokens, r.num_computed_tokens + n)
            for r, n in zip(requests, num_new_tokens)
            if r.images
        )

    def rows(
        self, spans: list[tuple[RequestState, int, int]], positions: np.ndarray
    ) -> tuple[ImageRows, np.ndarray | None]:
        """For the step's spans ((request, first flat row, tokens), each request computing from its
        `num_computed_tokens`) and its rows' positions: the image rows with their embeddings, and every
        row's query limit (int32; None where image tokens attend causally, Qwen2.5-VL's)."""
        pieces: list[tuple[ImageInput, int, int, int]] = []  # (image, first row, first token in it, count)
        for req, first, n in spans:
            start = req.num_computed_tokens
            for image in images_in(req.images, start, start + n):
                lo, hi = max(image.offset, start), min(image.end, start + n)
                pieces.append((image, first + lo - start, lo - image.offset, hi - lo))
                if hi < image.end:  # the rest in a later step
                    self.pins.setdefault(req.request_id, set()).add(image.key)
                elif req.request_id in self.pins:
                    self.pins[req.request_id].discard(image.key)
        self._encode([image for image, *_ in pieces])
        rows = np.concatenate([np.arange(row, row + count) for _, row, _, count in pieces])
        embeddings = torch.cat([self.cache[image.key][skip : skip + count] for image, _, skip, count in pieces])
        limits = None
        if self.bidirectional:  # Gemma 3: an image's tokens see all of it
            limits = positions.astype(np.int32)
            for image, row, _, count in pieces:
                limits[row : row + count] = image.end - 1
        self._evict()
        return ImageRows(torch.from_numpy(rows).to(self.device), embeddings), limits

    def _evict(self) -> None:
        """Drop the least recently used unpinned outputs past `CACHE_IMAGES` (after the step's own were read:
        a step may hold more)."""
        pinned = self._pinned()
        for key in [k for k in self.cache if k not in pinned][: max(0, len(self.cache) - CACHE_IMAGES)]:
            del self.cache[key]

    def _encode(self, images: list[ImageInput]) -> None:
        """Put every image's tower output in the cache (the missing ones in one batch), most recent last."""
        missing = list({im.key: im for im in images if im.key not in self.cache}.values())
        if missing:
            for im, embedding in zip(missing, self._tower(missing)):
                self.cache[im.key] = embedding
            self.num_encoded += len(missing)
        for im in images:
            self.cache.move_to_end(im.key)

    def _tower(self, images: list[ImageInput]) -> list[torch.Tensor] | torch.Tensor:
        """The images' embeddings [length, hidden] each, in one tower call."""
        grids = [im.grid for im in images if im.grid is not None]
        values = [np.frombuffer(im.pixels, dtype=np.float32) for im in images]
        if not grids:  # fixed-size images (Gemma 3): one batch
            pixels = np.stack([v.reshape(3, im.size, im.size) for v, im in zip(values, images)])
            return self.model.embed_images(torch.from_numpy(pixels).to(self.device))
        patches = np.concatenate([v.reshape(t * h * w, -1) for v, (t, h, w) in zip(values, grids)])
        out = self.model.embed_patches(torch.from_numpy(patches).to(self.device), grids)
        return list(out.split([im.length for im in images]))
