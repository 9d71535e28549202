"""Continuous batching: which requests run in the next step, and how many tokens each.

There is no separate prefill phase. Every request has `num_computed_tokens`; each step gives
running requests (decodes and unfinished prefill chunks) their share of the token budget first,
then admits waiting requests while budget, sequence slots and KV blocks last. A prompt longer
than the remaining budget is split into chunks over several steps. When blocks run out, the
newest running request is preempted: its blocks are freed and it is recomputed later. With a
model windowed in every layer, blocks that have left a request's window are released before each
step's allocations (see `BlockManager.drop_out_of_window`).

Computed-token counts advance when a step is launched (`advance`), not when its results arrive,
so that under async scheduling the next step can be planned while this one runs: a token sampled
by a step still in flight counts as known (`Request.num_inflight_tokens`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ember.config import SchedulerConfig
from ember.core.block_manager import BlockManager
from ember.core.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        preempted = False
        i = 0
        block_size = self.block_manager.block_size
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.is_length_capped(self.config.max_model_len):
                i += 1  # its last token is in flight; it finishes when that arrives
                continue
            self.block_manager.drop_out_of_window(request)
            n = min(request.num_scheduled_tokens - request.num_computed_tokens, budget)
            # Most decodes still have room in their last block: no allocation to ask for.
            fits = request.num_computed_tokens + n <= len(request.block_ids) * block_size
            while not fits and not self.block_manager.allocate(request, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                batch.requests.append(request)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1

        # Admitting new work right after a preemption would only thrash the cache.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_inflight_tokens:  # preempted mid-flight: readmitted once its token has arrived
                break
            prefix_blocks = self.block_manager.match_prefix(request)
            num_cached = len(prefix_blocks) * self.block_manager.block_size
            n = min(request.num_tokens - num_cached, budget)
            if not self.block_manager.allocate(request, n, prefix_blocks):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            self.block_manager.drop_out_of_window(request)  # a long cached prefix may reach past the window
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append(request)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def advance(self, batch: ScheduledBatch) -> list[Request]:
        """The batch has been launched: count its tokens as computed. Returns the requests that sample
        a token in it (those whose computed tokens reach every known or in-flight token)."""
        sampling = []
        for request, n in zip(batch.requests, batch.num_new_tokens):
            request.num_computed_tokens += n
            if request.num_computed_tokens == request.num_scheduled_tokens:
                request.num_inflight_tokens += 1
                sampling.append(request)
        return sampling

    def cache_full_blocks(self, request: Request) -> None:
        """Publish blocks that steps have filled with known tokens to the prefix cache."""
        self.block_manager.cache_full_blocks(request, min(request.num_computed_tokens, request.num_tokens))

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request, wherever it is, and free its blocks at once."""
        if request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.block_manager.free(request)

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()
