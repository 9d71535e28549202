"""Continuous batching: which requests run in the next step, and how many tokens each.

There is no separate prefill phase. Every request has `num_computed_tokens`; each step gives
running requests (decodes and unfinished prefill chunks) their share of the token budget first,
then admits waiting requests while budget, sequence slots and KV blocks last. A prompt longer
than the remaining budget is split into chunks over several steps. When blocks run out, the
newest running request is preempted: its blocks are freed and it is recomputed later. A prompt's
images bound where a chunk ends and how many a step starts (`EncoderBudget`). With a
model windowed in every layer, blocks that have left a request's window are released before each
step's allocations (see `BlockManager.drop_out_of_window`).

Computed-token counts advance when a step is launched (`advance`), not when its results arrive,
so that under async scheduling the next step can be planned while this one runs: a token sampled
by a step still in flight counts as known (`Request.num_inflight_tokens`).

With speculative decoding a decoding request also computes the draft tokens proposed for it
(`Request.spec_token_ids`), which count against the token budget; the core rolls its computed
tokens back past the drafts the model rejected, and `trim` releases blocks that then hold nothing.
How many drafts a request gets shrinks as the batch grows (`num_draft_tokens`).

Each batch carries the model runner's `StepDescription`: a request the runner has not seen in full,
then per step only what changed (new tokens and blocks), and the ids of the requests preempted or
finished since the last step, so the runner can keep its own per-request state.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field

from ember.config import SchedulerConfig, SpeculativeConfig
from ember.core.block_manager import BlockManager
from ember.core.encoder_budget import EncoderBudget
from ember.core.request import Request, RequestStatus
from ember.runner.step import NewRequest, StepDescription


@dataclass
class ScheduledBatch:
    """A planned step: its requests, for the core's bookkeeping, and the description the model runner
    gets (the same requests in the same order)."""

    requests: list[Request] = field(default_factory=list)
    step: StepDescription = field(default_factory=StepDescription)

    @property
    def num_new_tokens(self) -> list[int]:
        return self.step.num_new_tokens

    @functools.cached_property
    def drafts(self) -> dict[str, list[int]]:
        """Each request's draft tokens verified in this step, by id (read once the batch is planned)."""
        return dict(zip(self.step.request_ids, self.step.spec_token_ids))

    def __len__(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class DraftPolicy:
    """How many draft tokens requests get: `k` each while the batch's drafts stay within `budget`
    (see SpeculativeConfig.draft_budget_for). `lookahead`: a draft model proposes inside the step,
    writing its KV ahead of the tokens verified, so sampling requests get slots for k more tokens."""

    k: int
    budget: int
    lookahead: bool

    @classmethod
    def of(cls, config: SpeculativeConfig | None, device_type: str) -> DraftPolicy:
        if config is None:
            return cls(0, 0, False)
        return cls(config.num_speculative_tokens, config.draft_budget_for(device_type), config.needs_draft_model)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        drafts: DraftPolicy = DraftPolicy(0, 0, False),
        max_loras: int | None = None,
    ) -> None:
        """`max_loras`: with LoRA on, the most distinct adapters the running requests may use (device slots)."""
        self.config = config
        self.max_loras = max_loras
        self.block_manager = block_manager
        self.drafts = drafts
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Requests the runner must forget (or whose blocks it must drop) with the next step it gets.
        self._preempted_ids: list[str] = []
        self._finished_ids: list[str] = []
        self._trimmed: dict[str, int] = {}  # request id -> blocks it keeps, for the runner's table

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def num_draft_tokens(self) -> int:
        """Drafts per request for the batch as it is now: none once the running requests alone fill the
        draft budget (at 256 concurrent the step is compute bound, and verifying would cost)."""
        running = max(1, len(self.running))
        return min(self.drafts.k, self.drafts.budget // running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        encoder = EncoderBudget(self.config.max_num_encoder_input_tokens or budget, self.config.split_images)
        num_preemptions = self.num_preemptions
        i = 0
        block_size = self.block_manager.block_size
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.is_length_capped(self.config.max_model_len):
                i += 1  # its last token is in flight; it finishes when that arrives
                continue
            self.block_manager.drop_out_of_window(request)
            n = min(budget, request.num_scheduled_tokens - request.num_computed_tokens)
            n, encoded = encoder.fit(request.images, request.num_computed_tokens, n, budget, resumed=True)
            if n == 0:  # its next image does not fit this step's budgets: a later step
                i += 1
                continue
            drafts = request.spec_token_ids[: budget - n] if n == 1 and not request.num_inflight_tokens else []
            n += len(drafts)
            slots = n + self._lookahead(request, request.num_computed_tokens + n)
            new_blocks: list[int] = []
            # Most decodes still have room in their last block: no allocation to ask for.
            num_slots = len(self.block_manager.block_table(request.request_id)) * block_size
            if request.num_computed_tokens + slots > num_slots:
                allocated = self._allocate_or_preempt(request, slots)
                if allocated is None:  # preempted itself, the newest running request: the loop ends
                    continue
                new_blocks = allocated
            self._add(batch, request, n, new_blocks, drafts)
            budget -= n
            encoder.take(encoded)
            i += 1

        # Admitting new work right after a preemption would only thrash the cache.
        adapters = {r.lora_int_id for r in self.running} - {0}
        skipped: list[Request] = []  # waiting for a LoRA slot: they keep their place in the queue
        while (
            self.num_preemptions == num_preemptions
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if request.num_inflight_tokens:  # preempted mid-flight: readmitted once its token has arrived
                break
            if self._needs_lora_slot(request, adapters):
                skipped.append(self.waiting.popleft())
                continue
            prefix_blocks = self.block_manager.match_prefix(request)
            num_cached = len(prefix_blocks) * self.block_manager.block_size
            n = min(request.num_tokens - num_cached, budget)
            n, encoded = encoder.fit(request.images, num_cached, n, budget, resumed=False)
            if n == 0 or (n < request.num_tokens - num_cached and not self.config.chunked_prefill):
                break  # whole (an encoder's prompt, an image) or not at all: first in a later step
            allocation = self.block_manager.allocate(
                request, n + self._lookahead(request, num_cached + n), prefix_blocks
            )
            if allocation is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            self.block_manager.drop_out_of_window(request)  # a long cached prefix may reach past the window
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add(batch, request, n, allocation.block_ids)
            adapters.add(request.lora_int_id)
            adapters.discard(0)
            budget -= n
            encoder.take(encoded)
        self.waiting.extendleft(reversed(skipped))
        if batch:  # an empty batch is never launched: its ids wait for the next one
            batch.step.preempted_request_ids, self._preempted_ids = self._preempted_ids, []
            batch.step.finished_request_ids, self._finished_ids = self._finished_ids, []
            batch.step.trimmed_block_counts, self._trimmed = self._trimmed, {}
            if self.drafts.lookahead:
                batch.step.num_speculative_tokens = self.num_draft_tokens()
        return batch

    def _needs_lora_slot(self, request: Request, adapters: set[int]) -> bool:
        """Whether admitting the request would make the running requests use more adapters than max_loras."""
        lora_id = request.lora_int_id
        full = self.max_loras is not None and len(adapters) >= self.max_loras
        return full and lora_id != 0 and lora_id not in adapters

    def _lookahead(self, request: Request, computed_after: int) -> int:
        """Slots past the step's tokens that a draft model writes when the request samples in it, i.e. when
        the step computes it up to `computed_after` >= its known tokens (clipped to the context window:
        the runner writes nothing past the request's blocks)."""
        if not self.drafts.lookahead or computed_after < request.num_scheduled_tokens:
            return 0
        # as many as it will draft: none while the batch turns drafts off
        return max(0, min(self.num_draft_tokens(), self.config.max_model_len - request.num_scheduled_tokens - 1))

    def _allocate_or_preempt(self, request: Request, n: int) -> list[int] | None:
        """Blocks for n more tokens of a running request, preempting the newest running requests until they
        fit: the blocks added, or None when the request itself had to go."""
        while (allocation := self.block_manager.allocate(request, n)) is None:
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return None
        return allocation.block_ids

    @staticmethod
    def _add(
        batch: ScheduledBatch, request: Request, n: int, new_block_ids: list[int], drafts: list[int] | None = None
    ) -> None:
        """Put n tokens of the request in the batch, telling the runner what it has not heard of it yet."""
        if not request.num_tokens_sent:
            batch.step.new_requests.append(
                NewRequest(
                    request.request_id,
                    request.prompt_token_ids,
                    request.sampling_params,
                    request.eos_token_ids,
                    request.lora_request,
                    request.pooling_params,
                    request.images,
                )
            )
            request.num_tokens_sent = request.num_prompt_tokens
        batch.step.add(
            request.request_id,
            n,
            request.num_computed_tokens,
            request.num_inflight_tokens,
            request.all_token_ids[request.num_tokens_sent :],
            new_block_ids,
            drafts,
        )
        request.num_tokens_sent = request.num_tokens
        batch.requests.append(request)

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._preempted_ids.append(request.request_id)

    def advance(self, batch: ScheduledBatch) -> list[Request]:
        """The batch has been launched: count its tokens as computed. Returns the requests that sample
        a token in it (those whose computed tokens reach every known or in-flight token)."""
        sampling = []
        for request, n in zip(batch.requests, batch.num_new_tokens):
            request.num_computed_tokens += n
            if request.num_computed_tokens >= request.num_scheduled_tokens:  # past them by its drafts
                request.num_inflight_tokens += 1
                sampling.append(request)
        return sampling

    def reject_drafts(self, request: Request, num_rejected: int) -> None:
        """The model rejected the request's last `num_rejected` computed tokens (drafts): roll its
        computed count back, so their slots are written again, and release blocks past what it holds."""
        if not num_rejected:
            return
        request.num_computed_tokens -= num_rejected
        kept = self.block_manager.trim(request, request.num_computed_tokens)
        if kept is not None:
            self._trimmed[request.request_id] = kept

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
        if request.num_tokens_sent:
            self._finished_ids.append(request.request_id)

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()
