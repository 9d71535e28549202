"""What the scheduler tells the model runner each step, and what the runner answers: plain data only.

The runner never sees the core's requests. A request reaches it once, as a `NewRequest` (its
prompt, sampling parameters and EOS ids), and from then on as a few numbers and deltas per step it
is scheduled in: the output tokens the host has learned since the last step it was in, the KV
blocks allocated to it since then, its computed-token count and its tokens still in flight on the
device. Finished requests are listed so that the runner forgets them, preempted ones so that it
drops their block table (their blocks are freed; a resumed request's blocks come again as new
ones). A description so grows with the number of requests it schedules, never with their lengths.

Results go back keyed by request id. This module imports no torch, so the core and the runner may
both import it (the runner imports nothing from the core).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.lora.request import LoRARequest
from ember.messages import Logprobs
from ember.multimodal.inputs import ImageInput
from ember.pooling.params import PoolingParams
from ember.sampling.params import SamplingParams


@dataclass
class NewRequest:
    """A request the runner has not seen: what never changes while it lives. A seeded random
    request's generator is the runner's, made from `sampling_params.seed`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]  # held back while min_tokens is not reached
    lora_request: LoRARequest | None = None  # the adapter its tokens run under
    pooling_params: PoolingParams | None = None  # set: pooled once its prompt is computed, never sampled
    images: list[ImageInput] = field(default_factory=list)  # its prompt's images (a vision model's)


@dataclass
class StepDescription:
    """One step. The per-request lists are parallel, in the order the scheduler scheduled the
    requests; `new_requests` holds the first-time ones among them."""

    request_ids: list[str] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens to compute this step
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    # Tokens sampled by the step before, whose values are still on the device (async scheduling).
    num_inflight_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # output tokens new to the runner
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended to the request's block table
    # Draft tokens computed after the request's known tokens and verified this step (part of num_new_tokens).
    spec_token_ids: list[list[int]] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    # Handled before this step's requests, preempted first: a request may be preempted, then end,
    # before the next step, and its id may then come back as a new request.
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    # Requests whose block tables lost their tail blocks (rejected drafts' slots): blocks each keeps.
    trimmed_block_counts: dict[str, int] = field(default_factory=dict)
    # Drafts a draft model or EAGLE-3 head proposes, per sampling request, for the next step (0: none).
    num_speculative_tokens: int = 0

    def __len__(self) -> int:
        return len(self.request_ids)

    def add(
        self,
        request_id: str,
        num_new_tokens: int,
        num_computed_tokens: int,
        num_inflight_tokens: int,
        new_token_ids: list[int],
        new_block_ids: list[int],
        spec_token_ids: list[int] | None = None,
    ) -> None:
        self.request_ids.append(request_id)
        self.num_new_tokens.append(num_new_tokens)
        self.num_computed_tokens.append(num_computed_tokens)
        self.num_inflight_tokens.append(num_inflight_tokens)
        self.new_token_ids.append(new_token_ids)
        self.new_block_ids.append(new_block_ids)
        self.spec_token_ids.append(spec_token_ids or [])


@dataclass
class StepResult:
    """What a finished step sampled, on the host."""

    request_ids: list[str]  # the requests that sampled tokens, in row order
    token_ids: list[list[int]]  # per request: its accepted draft tokens, then the one sampled (one without drafts)
    logprobs: list[Logprobs | None]  # per request, a row per token; None where not asked
    prompt_logprobs: dict[str, tuple[int, Logprobs]] = field(default_factory=dict)  # (first position, rows)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # a drafter model's proposals
    pooled: dict[str, list[float]] = field(default_factory=dict)  # pooling requests whose prompt ended this step
