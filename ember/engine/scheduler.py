"""Continuous batching: which requests run in the next step, and how many tokens each.

There is no separate prefill phase. Every request has `num_computed_tokens`; each step gives
running requests (decodes and unfinished prefill chunks) their share of the token budget first,
then admits waiting requests while budget, sequence slots and KV blocks last. A prompt longer
than the remaining budget is split into chunks over several steps. When blocks run out, the
newest running request is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ember.config import SchedulerConfig
from ember.engine.block_manager import BlockManager
from ember.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

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

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        i = 0
        block_size = self.block_manager.block_size
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            # Most decodes still have room in their last block: no allocation to ask for.
            fits = request.num_computed_tokens + n <= len(request.block_ids) * block_size
            while not fits and not self.block_manager.allocate(request, n):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    break
            else:
                batch.requests.append(request)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1

        # Admitting new work right after a preemption would only thrash the cache.
        while not batch.preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            prefix_blocks = self.block_manager.match_prefix(request)
            num_cached = len(prefix_blocks) * self.block_manager.block_size
            n = min(request.num_tokens - num_cached, budget)
            if not self.block_manager.allocate(request, n, prefix_blocks):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
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
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def after_step(self, batch: ScheduledBatch) -> None:
        """Advance computed-token counts and publish newly filled blocks to the prefix cache."""
        block_size = self.block_manager.block_size
        for request, n in zip(batch.requests, batch.num_new_tokens):
            before = request.num_computed_tokens // block_size
            request.num_computed_tokens += n
            if request.num_computed_tokens // block_size > before:  # a block filled up
                self.block_manager.cache_full_blocks(request)

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
