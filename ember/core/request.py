"""A sequence inside the engine core: its tokens, computed-token count and status.

Written by the scheduler and the core; the block manager only reads it (it keeps the request's KV block
table and prefix hashes itself, `BlockManager.block_table`). The front end never sees it (it gets
`EngineCoreOutput` messages instead), nor does the model runner (it gets step descriptions, ember/runner/step.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember.lora.request import LoRARequest
from ember.messages import EngineCoreRequest
from ember.multimodal.inputs import ImageInput
from ember.pooling.params import PoolingParams
from ember.sampling.params import SamplingParams

if TYPE_CHECKING:
    import llguidance


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: list[int]
    arrival_time: float

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens sampled by a step still running on the device (async scheduling): counted as known,
    # so the next step can be scheduled before their values reach the host.
    num_inflight_tokens: int = 0
    num_cached_tokens: int = -1
    num_prompt_logprobs_sent: int = 1  # prompt position of the next prompt logprob to report
    num_tokens_sent: int = 0  # tokens the model runner has been told of; 0 until it has seen the request
    stop_reason: int | None = None
    matcher: llguidance.LLMatcher | None = None  # its structured-output grammar's state
    num_grammar_tokens: int = 0  # output tokens the matcher has consumed (it may run ahead of the host's list)
    grammar_error: str | None = None  # why the grammar cannot go on, once a token it was fed ended it
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed for its next step to verify
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None  # an embedding request: it ends with its prompt, pooled
    skip_prefix_cache: bool = False  # it needs every prompt position computed (MEAN / CLS pooling)
    images: list[ImageInput] = field(default_factory=list)  # its prompt's images (a vision model's)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @classmethod
    def from_message(cls, msg: EngineCoreRequest) -> Request:
        return cls(
            msg.request_id,
            msg.prompt_token_ids,
            msg.sampling_params,
            msg.max_tokens,
            msg.eos_token_ids,
            msg.arrival_time,
            lora_request=msg.lora_request,
            pooling_params=msg.pooling_params,
            images=msg.images,
        )

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens whose values the host knows."""
        return len(self.all_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens known or in flight: what the next step may compute up to."""
        return len(self.all_token_ids) + self.num_inflight_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_host_tokens(self) -> bool:
        """Its next step needs every earlier token on the host: penalties count the output tokens, a
        bad word of several tokens is banned by what the output ends with, and prompt logprobs are read
        back while computing (async scheduling waits for such requests). A grammar's mask needs the last
        token too, but only on the host's side: the mask thread waits for it while the next forward runs
        (`EngineCore._start_masks`)."""
        p = self.sampling_params
        return (
            p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or p.repetition_penalty != 1.0
            or p.prompt_logprobs is not None
            or any(len(seq) > 1 for seq in p.bad_words_token_ids or ())
        )

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """Finish conditions that depend only on the token just sampled and the lengths."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            assert params.stop_token_ids is not None  # SamplingParams.__post_init__ normalises it to a list
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def max_drafts(self, max_model_len: int) -> int:
        """Drafts its next step may verify: all accepted, plus the model's own token, must stay within
        max_tokens and the context window."""
        return max(0, min(self.max_tokens - self.num_output_tokens, max_model_len - self.num_tokens) - 1)

    def is_length_capped(self, max_model_len: int) -> bool:
        """Its tokens in flight already reach a length limit: nothing more to compute for it. A pooling
        request's prompt may fill the context window: it is done once its last chunk is in flight."""
        if self.pooling_params is not None:
            return self.num_inflight_tokens > 0
        return (
            self.num_output_tokens + self.num_inflight_tokens >= self.max_tokens
            or self.num_scheduled_tokens >= max_model_len
        )
