"""Images in the scheduler and the runner's cache of tower outputs, without a model (docs/multimodal.md,
"Scheduling images"): where prefill chunks end (inside an image where its tokens attend causally, never
where they attend both ways), the encoder budget (a second image waits for a later step; an image longer
than the budget is encoded alone), and the pins on partly computed images (released when the request
finishes, is aborted or is preempted; the outputs stay cached). The greedy tokens against HF are in
tests/test_qwen25_vl.py and tests/test_vision.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ember.config import SchedulerConfig
from ember.core.block_manager import BlockManager
from ember.core.request import Request, RequestStatus
from ember.core.scheduler import Scheduler
from ember.multimodal.inputs import ImageInput
from ember.runner.images import CACHE_IMAGES, StepImages
from ember.runner.request_state import RequestState
from ember.sampling.params import SamplingParams


def _image(offset: int, length: int, key: str = "") -> ImageInput:
    return ImageInput(offset, length, key or f"{offset}/{length}", 0, b"", (1, 2, 2 * length))


def _request(rid: str, num_tokens: int, images: list[ImageInput]) -> Request:
    return Request(rid, list(range(num_tokens)), SamplingParams(max_tokens=1), 1, [], 0.0, images=images)


def _chunks(requests: list[Request], **config) -> list[dict[str, tuple[int, int]]]:
    """Each step's chunks [start, end) by request id, until every prompt is computed (one token each)."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_model_len=256, **config), BlockManager(64, 4, enable_prefix_caching=False)
    )
    for r in requests:
        scheduler.add(r)
    steps = []
    while any(not r.status.finished for r in requests):
        batch = scheduler.schedule()
        assert batch, "nothing could be scheduled: a deadlock"
        steps.append(
            {
                r.request_id: (r.num_computed_tokens, r.num_computed_tokens + n)
                for r, n in zip(batch.requests, batch.num_new_tokens)
            }
        )
        for r in scheduler.advance(batch):
            r.num_inflight_tokens -= 1
            scheduler.finish(r, RequestStatus.FINISHED_LENGTH)
    return steps


def test_a_chunk_ends_inside_an_image_where_its_tokens_attend_causally():
    # an 8-token image at [4, 12) under a 4-token budget: three chunks, two of them inside the image
    steps = _chunks([_request("a", 14, [_image(4, 8)])], max_num_batched_tokens=4)
    assert [s["a"] for s in steps] == [(0, 4), (4, 8), (8, 12), (12, 14)]


def test_a_chunk_holds_an_image_whole_where_its_tokens_attend_both_ways():
    # Gemma 3: the chunk that would cut the image at [6, 10) ends before it
    steps = _chunks([_request("a", 20, [_image(6, 4)])], max_num_batched_tokens=8, split_images=False)
    assert [s["a"] for s in steps] == [(0, 6), (6, 14), (14, 20)]


def test_the_encoder_budget_delays_a_second_image_to_a_later_step():
    a, b = _request("a", 12, [_image(2, 6)]), _request("b", 12, [_image(3, 6, "other")])
    together = _chunks([a, b], max_num_batched_tokens=64)
    assert together == [{"a": (0, 12), "b": (0, 12)}]
    a, b = _request("a", 12, [_image(2, 6)]), _request("b", 12, [_image(3, 6, "other")])
    steps = _chunks([a, b], max_num_batched_tokens=64, max_num_encoder_input_tokens=8)
    assert steps == [{"a": (0, 12), "b": (0, 3)}, {"b": (3, 12)}]  # b's text before its image goes first
    # one request's two images, the same way
    steps = _chunks(
        [_request("c", 20, [_image(2, 6), _image(10, 6)])], max_num_batched_tokens=64, max_num_encoder_input_tokens=8
    )
    assert [s["c"] for s in steps] == [(0, 10), (10, 20)]


@pytest.mark.parametrize("split_images", [True, False])
def test_an_image_longer_than_the_encoder_budget_is_encoded_alone(split_images):
    small, large = _request("s", 8, [_image(1, 4)]), _request("l", 16, [_image(2, 12)])
    steps = _chunks(
        [small, large], max_num_batched_tokens=64, max_num_encoder_input_tokens=6, split_images=split_images
    )
    assert steps == [{"s": (0, 8), "l": (0, 2)}, {"l": (2, 16)}]


class _Tower:
    """A stand-in for the model: row i of an image's output is i (its images' rows in a row), calls counted."""

    config = SimpleNamespace(vision=None)  # a causal model's: no query limits

    def __init__(self) -> None:
        self.calls = 0

    def embed_patches(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        self.calls += 1
        return torch.arange(sum(t * h * w // 4 for t, h, w in grids), dtype=torch.float32)[:, None]


def _state(rid: str, image: ImageInput, computed: int) -> RequestState:
    state = RequestState(rid, [0] * 16, SamplingParams(), [], images=[image])
    state.num_computed_tokens = computed
    return state


def test_a_partly_computed_image_stays_pinned_until_its_request_is_done_with_it():
    tower = _Tower()
    images = StepImages(tower, torch.device("cpu"))  # type: ignore[arg-type]
    image = ImageInput(2, 8, "k", 0, np.zeros((32, 1), np.float32).tobytes(), (1, 4, 8))
    rows, _ = images.rows([(_state("a", image, 0), 0, 4)], np.arange(4))  # tokens [0, 4): the image's [0, 2)
    assert rows.rows.tolist() == [2, 3] and rows.embeddings[:, 0].tolist() == [0, 1]
    assert images.num_pinned == 1 and tower.calls == 1
    # other pictures pass through the cache meanwhile: the pinned output is not evicted
    for i in range(CACHE_IMAGES + 1):
        other = ImageInput(0, 1, f"o{i}", 0, np.zeros((4, 1), np.float32).tobytes(), (1, 2, 2))
        images.rows([(_state(f"o{i}", other, 0), 0, 1)], np.arange(1))
    assert "k" in images.cache and len(images.cache) == CACHE_IMAGES
    rows, _ = images.rows([(_state("a", image, 4), 0, 4)], np.arange(4, 8))  # the image's [2, 6): no tower
    assert rows.embeddings[:, 0].tolist() == [2, 3, 4, 5] and tower.calls == CACHE_IMAGES + 2
    images.rows([(_state("a", image, 8), 0, 4)], np.arange(8, 12))  # its last two tokens: unpinned
    assert images.num_pinned == 0
    # preempted or aborted in the middle of the image: released, and its output stays cached for reuse
    images.rows([(_state("b", image, 0), 0, 5)], np.arange(5))
    assert images.num_pinned == 1
    images.release(["b"])
    assert images.num_pinned == 0 and "k" in images.cache and tower.calls == CACHE_IMAGES + 2
