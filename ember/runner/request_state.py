"""The runner's own view of each request, kept up to date from the step descriptions.

A `RequestState` holds what filling a step's inputs and sampling it need: the tokens known on the
host (the prompt, then the output tokens as the descriptions bring them), the block table, the
computed and in-flight token counts of the step being prepared, and the generator of a seeded
request, which lives as long as the request (a preempted request's draws continue one stream).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ember.lora.request import LoRARequest
from ember.multimodal.inputs import ImageInput
from ember.pooling.params import PoolingParams
from ember.runner.linear_state import StateSlots
from ember.runner.step import NewRequest, StepDescription
from ember.sampling.params import SamplingParams


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    generator: torch.Generator | None = None
    lora_request: LoRARequest | None = None
    token_ids: list[int] = field(default_factory=list)  # known on the host: the prompt, then output tokens
    output_token_ids: list[int] = field(default_factory=list)  # known on the host (penalties count them)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_inflight_tokens: int = 0  # sampled, values still on the device
    spec_token_ids: list[int] = field(default_factory=list)  # drafts computed after the known tokens this step
    pooling_params: PoolingParams | None = None  # a pooling request (ember/runner/pooler.py)
    pooled: torch.Tensor | None = None  # its pooling so far: MEAN's running sum, CLS's first row (float32)
    images: list[ImageInput] = field(default_factory=list)  # its prompt's images (ember/runner/images.py)
    mrope_delta: int | None = None  # M-RoPE: position minus index after the prompt's last image (set once)
    # its slot in the linear-attention state pool while scheduled (ember/runner/linear_state.py); None without
    state_slot: int | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @classmethod
    def from_new(cls, new: NewRequest, device: torch.device) -> RequestState:
        params = new.sampling_params
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        return cls(
            new.request_id,
            new.prompt_token_ids,
            params,
            new.eos_token_ids,
            generator,
            new.lora_request,
            pooling_params=new.pooling_params,
            images=new.images,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens whose values the host knows."""
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens known or in flight: a step computing up to them samples the next one."""
        return len(self.token_ids) + self.num_inflight_tokens

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far, those in flight included."""
        return len(self.output_token_ids) + self.num_inflight_tokens

    def input_token_ids(self, start: int, end: int) -> list[int]:
        """The known tokens, then this step's drafts, from position start to end."""
        if end <= len(self.token_ids):
            return self.token_ids[start:end]
        return (self.token_ids[start:] + self.spec_token_ids)[: end - start]

    def append_tokens(self, token_ids: list[int]) -> None:
        self.token_ids.extend(token_ids)
        self.output_token_ids.extend(token_ids)


class RequestStates:
    """Every request the runner knows, by id. With `slots` (a model with linear-attention layers) each
    request holds a state slot from the step that first schedules it until it finishes or is preempted
    (a preempted request recomputes its prompt from a fresh slot)."""

    def __init__(self, device: torch.device, slots: StateSlots | None = None) -> None:
        self.device = device
        self.slots = slots
        self._states: dict[str, RequestState] = {}

    def _release(self, state: RequestState | None) -> None:
        if state is not None and state.state_slot is not None and self.slots is not None:
            self.slots.free(state.state_slot)
            state.state_slot = None

    def __len__(self) -> int:
        return len(self._states)

    def update(self, step: StepDescription) -> list[RequestState]:
        """Apply a step's description; returns the states of its requests, in its order. A new request
        replaces any state of the same id (warm-up reuses its ids)."""
        states = self._states
        for request_id, kept in step.trimmed_block_counts.items():
            if request_id in states:
                del states[request_id].block_ids[kept:]
        for request_id in step.preempted_request_ids:
            states[request_id].block_ids = []
            self._release(states[request_id])
        for request_id in step.finished_request_ids:
            self._release(states.pop(request_id, None))
        for new in step.new_requests:
            self._release(states.get(new.request_id))
            states[new.request_id] = RequestState.from_new(new, self.device)
        scheduled = []
        for request_id, computed, inflight, tokens, blocks, drafts in zip(
            step.request_ids,
            step.num_computed_tokens,
            step.num_inflight_tokens,
            step.new_token_ids,
            step.new_block_ids,
            step.spec_token_ids,
            strict=True,
        ):
            state = states[request_id]
            if tokens:
                state.append_tokens(tokens)
            if blocks:
                state.block_ids.extend(blocks)
            state.num_computed_tokens, state.num_inflight_tokens = computed, inflight
            state.spec_token_ids = drafts
            if self.slots is not None and state.state_slot is None:
                state.state_slot = self.slots.allocate()
            scheduled.append(state)
        return scheduled

    def clear(self) -> None:
        self._states.clear()
        if self.slots is not None:
            self.slots.reset()
