"""The runner's per-request state, rebuilt from nothing but the scheduler's step descriptions, matches the
core's requests at every step: through chunked prefills, preemptions (blocks dropped, then sent again on
resumption), prefix-cache hits, finished requests and, with two steps in flight, tokens whose values
reach the host one step late. No model: each sampled token is a function of the request's tokens."""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from ember.config import SchedulerConfig
from ember.core.block_manager import BlockManager
from ember.core.request import Request, RequestStatus
from ember.core.scheduler import ScheduledBatch, Scheduler
from ember.runner.request_state import RequestStates
from ember.sampling.params import SamplingParams

VOCAB = 50
MAX_MODEL_LEN = 256


def _check_mirrors(batch: ScheduledBatch, states: RequestStates, blocks: BlockManager) -> None:
    for req, state in zip(batch.requests, states.update(batch.step), strict=True):
        assert state.request_id == req.request_id
        assert state.token_ids == req.all_token_ids and state.output_token_ids == req.output_token_ids
        assert state.block_ids == blocks.block_table(req.request_id)
        assert (state.num_computed_tokens, state.num_inflight_tokens) == (
            req.num_computed_tokens,
            req.num_inflight_tokens,
        )


def _collect(batch: ScheduledBatch, sampled: list[Request], scheduler: Scheduler) -> None:
    for req in sampled:
        req.num_inflight_tokens -= 1
        if req.status.finished:
            continue
        req.append_token(sum(req.all_token_ids) % VOCAB)
        if req.check_stop(req.all_token_ids[-1], MAX_MODEL_LEN) is not None:
            scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
    for req in batch.requests:
        if not req.status.finished:
            scheduler.cache_full_blocks(req)


def _run(scheduler: Scheduler, states: RequestStates, requests: list[Request], depth: int) -> None:
    """Step like the engine core with `depth` steps in flight, checking every description on the way."""
    for req in requests:
        scheduler.add(req)
    inflight: deque[tuple[ScheduledBatch, list[Request]]] = deque()
    while any(not r.status.finished for r in requests) or inflight:
        batch = scheduler.schedule()
        if batch:
            _check_mirrors(batch, states, scheduler.block_manager)
            inflight.append((batch, scheduler.advance(batch)))
        if inflight and (len(inflight) >= depth or not batch):
            _collect(*inflight.popleft(), scheduler)


@pytest.mark.parametrize("depth", [1, 2])
def test_runner_state_follows_the_core_through_preemption_and_prefix_hits(depth: int) -> None:
    rng = random.Random(depth)
    shared = [rng.randrange(VOCAB) for _ in range(20)]
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    manager = BlockManager(24, 4, enable_prefix_caching=True)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN), manager
    )
    states = RequestStates(torch.device("cpu"))
    requests = [Request(str(i), p, SamplingParams(max_tokens=20), 20, [], 0.0) for i, p in enumerate(prompts)]
    _run(scheduler, states, requests, depth)
    assert scheduler.num_preemptions > 0 and manager.prefix_cache_hits > 0
    assert all(r.num_output_tokens == 20 for r in requests)

    # The next step tells the runner to forget every request that has ended; a reused id starts afresh.
    again = Request("0", [1, 2, 3], SamplingParams(max_tokens=2), 2, [], 0.0)
    _run(scheduler, states, [again], depth)
    assert len(states) == 1
