"""Early release of KV blocks that have left the sliding window of a model windowed in every layer.

The scheduler and block manager run here without a model: a stand-in "KV cache" maps each slot to
the token prefix whose key it holds, every step writes its new tokens' entries through the request's
block list, and every query reads back each position of its window through the same list. A block
released too early (then reused by another request) shows as a wrong entry; the stand-in's next
token is a function of what its window read, so a wrong read also changes the tokens. Each run
must end with every block free.
"""

from __future__ import annotations

import random

import pytest

from ember.config import SchedulerConfig
from ember.core.block_manager import BlockManager
from ember.core.request import Request, RequestStatus
from ember.core.scheduler import Scheduler
from ember.sampling.params import SamplingParams

BLOCK_SIZE = 4
VOCAB = 50


class WindowedStandIn:
    """Steps the scheduler like the engine core (one step at a time) with a fake attention of the
    given window over a slot -> token-prefix map."""

    def __init__(
        self, window: int, num_blocks: int, freeing: bool, prefix_caching: bool = True, max_num_batched_tokens: int = 16
    ) -> None:
        self.window = window
        self.manager = BlockManager(num_blocks, BLOCK_SIZE, prefix_caching, sliding_window=window if freeing else None)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens, max_model_len=512),
            self.manager,
        )
        self.slots: dict[int, tuple[int, ...]] = {}
        self.peak_blocks = 0

    def _slot(self, request: Request, pos: int) -> int:
        return self.manager.block_table(request.request_id)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    def _step(self) -> None:
        batch = self.scheduler.schedule()
        assert batch, "nothing scheduled while requests remain"
        self.peak_blocks = max(self.peak_blocks, self.manager.num_blocks - self.manager.num_free_blocks)
        last_reads = {}
        for request, n in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens
            tokens = request.all_token_ids
            for pos in range(start, start + n):
                self.slots[self._slot(request, pos)] = tuple(tokens[: pos + 1])
            for pos in range(start, start + n):  # each query reads its window back
                read = []
                for j in range(max(0, pos - self.window + 1), pos + 1):
                    block_id = self.manager.block_table(request.request_id)[j // BLOCK_SIZE]
                    assert self.manager.blocks[block_id].ref_cnt > 0, "read a released block"
                    read.append(self.slots[self._slot(request, j)])
                    assert read[-1] == tuple(tokens[: j + 1]), f"{request.request_id} position {j} holds other KV"
                last_reads[request.request_id] = read
        for request in self.scheduler.advance(batch):
            request.num_inflight_tokens -= 1
            # The next token is a function of the entries its window read.
            request.append_token(hash(tuple(last_reads[request.request_id])) % VOCAB)
            if request.check_stop(request.all_token_ids[-1], 512) is not None:
                self.scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
        for request in batch.requests:
            if not request.status.finished:
                self.scheduler.cache_full_blocks(request)

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        requests = [
            Request(str(i), p, SamplingParams(max_tokens=max_tokens), max_tokens, [], 0.0)
            for i, p in enumerate(prompts)
        ]
        for request in requests:
            self.scheduler.add(request)
        while any(not r.status.finished for r in requests):
            self._step()
        assert self.manager.num_free_blocks == self.manager.num_blocks  # no leak
        assert all(block.ref_cnt == 0 for block in self.manager.blocks)
        assert not any(self.manager.block_table(r.request_id) for r in requests)  # no table outlives its request
        return [r.output_token_ids for r in requests]


def prompts(seed: int, count: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared)]
    return [prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(count)]


@pytest.mark.parametrize("window", [1, 3, 4, 9, 16])
def test_windowed_requests_read_their_whole_window_and_free_everything(window: int) -> None:
    batch = prompts(window, 6)
    kept = WindowedStandIn(window, num_blocks=200, freeing=False)
    freed = WindowedStandIn(window, num_blocks=200, freeing=True)
    assert freed.run(batch, 40) == kept.run(batch, 40)
    assert freed.peak_blocks < kept.peak_blocks


def test_a_long_request_holds_only_its_window() -> None:
    """One request of 160 tokens through a 9-token window: a block left over at each end at most,
    plus the one allocated ahead for the next step's tokens."""
    stand_in = WindowedStandIn(9, num_blocks=200, freeing=True, max_num_batched_tokens=8)
    stand_in.run(prompts(1, 1), 150)
    assert stand_in.peak_blocks <= -(-9 // BLOCK_SIZE) + 3


def test_preemption_and_prefix_hits_with_released_blocks() -> None:
    """Requests sharing a 24-token prefix, in a pool too small for all of them at once: some are
    preempted and recomputed, later ones hit the prefix blocks that earlier ones released while
    those still held their cached tokens, and nothing reads a block that another request rewrote."""
    batch = prompts(7, 8, shared=24)
    kept = WindowedStandIn(16, num_blocks=20, freeing=False)
    freed = WindowedStandIn(16, num_blocks=20, freeing=True)
    assert freed.run(batch, 30) == kept.run(batch, 30)
    assert freed.scheduler.num_preemptions > 0  # measured: 5 (12 keeping every block)
    assert freed.scheduler.num_preemptions < kept.scheduler.num_preemptions
    assert freed.manager.prefix_cache_hits > 0


def test_released_blocks_are_not_cached_afterwards() -> None:
    """A block released before the step that filled it was registered is never registered: by then
    it may already hold another request's KV."""
    manager = BlockManager(16, BLOCK_SIZE, True, sliding_window=2)
    request = Request("r", list(range(12)), SamplingParams(max_tokens=1), 1, [], 0.0)
    assert manager.allocate(request, 12, manager.match_prefix(request))
    request.num_computed_tokens = 12  # computed, not yet registered (the step is still in flight)
    manager.drop_out_of_window(request)  # the next query (position 12) sees 11 and 12 only
    assert manager.num_free_blocks == 16 - 1
    manager.cache_full_blocks(request, 12)
    assert set(manager.cached_blocks.values()) == {manager.block_table("r")[2]}
    manager.free(request)
    assert manager.num_free_blocks == 16
