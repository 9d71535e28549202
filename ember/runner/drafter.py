"""Drafters that run inside the step: a smaller model of the same vocabulary (`draft_model`) or an EAGLE-3
head on the target's hidden states (`eagle3`) proposes the next step's drafts right after the target
has verified this step's.

Each keeps its own KV tensors for the same blocks as the target's (the scheduler's block tables
serve both; a block's bytes count both), so a step first runs the drafter over the step's own
positions (its KV for every position the target computed; a rejected draft's slot is garbage that a
later step overwrites before anything reads it), then one-token steps from each request's last emitted
token, taking the argmax each time: drafts are greedy, and verification treats them as one-hot
(ember/sampling/rejection.py), so the output is exact whatever they are.

- draft_model: the catch-up forward reads the step's tokens; k one-token steps follow.
- eagle3: the head reads, at position q, token q + 1 and the target's residual stream entering three
  of its layers at q (`CausalLM.aux_hidden_states`), so its catch-up forward runs on the step's tokens
  shifted by one, the emitted tokens filled in; its row at the last emitted token's position gives the
  first draft, and k - 1 one-token steps on its own hidden state follow.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ember.model.eagle3 import Eagle3Draft
from ember.model.llama import CausalLM
from ember.ops.attention import AttentionMetadata
from ember.runner.kv_cache import KVCache
from ember.runner.request_state import RequestState
from ember.sampling.rejection import Verified
from ember.transfer import array_to_device, to_device


@dataclass
class DraftStep:
    """The step the target just ran, as a drafter sees it."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    spans: list[tuple[RequestState, int, int]]  # (request, first flat row, tokens), in row order
    samplers: list[RequestState]  # the requests that sampled, in sampling-row order
    verified: Verified | None  # their emitted tokens (None: no request sampled)
    aux_hidden_states: torch.Tensor | None  # [T, 3 * hidden]: the target's features (eagle3)

    @functools.cached_property
    def emitted_counts(self) -> list[int]:
        """Tokens each sampling request emitted (read back to the host once)."""
        assert self.verified is not None  # asked only of a step that sampled
        return self.verified.num_tokens.tolist()


def decode_metadata(
    requests: list[RequestState], positions: list[int], block_size: int, device: torch.device
) -> tuple[AttentionMetadata, torch.Tensor]:
    """A one-token-per-request batch at `positions`, through the requests' block tables. A position past
    a request's blocks (drafting past the context window, clipped later) is written nowhere and
    attends to what the blocks hold."""
    n = len(requests)
    width = max(len(r.block_ids) for r in requests)
    tables = np.zeros((n, width), dtype=np.int32)
    lengths = np.empty(n, dtype=np.int64)
    for i, r in enumerate(requests):
        tables[i, : len(r.block_ids)] = r.block_ids
        lengths[i] = len(r.block_ids)
    pos = np.asarray(positions, dtype=np.int64)
    block = pos // block_size
    inside = block < lengths
    slots = np.where(inside, tables[np.arange(n), np.minimum(block, width - 1)] * block_size + pos % block_size, -1)
    seq_lens = np.minimum(pos + 1, lengths * block_size).astype(np.int32)
    starts = np.arange(n + 1, dtype=np.int32)
    meta = AttentionMetadata(
        slot_mapping=array_to_device(slots, device),
        block_tables=array_to_device(tables, device),
        seq_lens=array_to_device(seq_lens, device),
        query_start_loc=array_to_device(starts, device),
        num_decodes=n,
        max_query_len=0,
        max_seq_len=int(seq_lens.max()),
        seq_lens_host=seq_lens.tolist(),
        query_start_host=starts.tolist(),
    )
    return meta, array_to_device(pos, device)


class DraftModelDrafter:
    def __init__(self, model: CausalLM, kv_cache: KVCache, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device

    def prefill(self, step: DraftStep) -> None:
        """The draft model's KV for the step's tokens: the same inputs, slots and block tables."""
        self.model(step.input_ids, step.positions, step.meta)

    def propose(self, step: DraftStep, k: int) -> list[list[int]]:
        """k greedy drafts per sampling request, continuing from its last emitted token."""
        self.prefill(step)
        last = [r.num_tokens - 1 + c for r, c in zip(step.samplers, step.emitted_counts)]
        assert step.verified is not None  # proposals follow a step that sampled
        tokens, drafts = step.verified.last_tokens(), []
        for j in range(k):
            meta, pos = decode_metadata(step.samplers, [p + j for p in last], self.block_size, self.device)
            tokens = self.model.greedy_tokens(self.model(tokens, pos, meta))
            drafts.append(tokens)
        return torch.stack(drafts, dim=1).tolist()


class Eagle3Drafter:
    def __init__(self, head: Eagle3Draft, kv_cache: KVCache, block_size: int, device: torch.device) -> None:
        self.head = head
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device

    def catch_up(self, step: DraftStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over the step's rows (row q: token q + 1, the target's features at q): its KV, and its
        (h_normed, h_prenorm) per row."""
        assert step.aux_hidden_states is not None  # the target keeps them whenever an EAGLE-3 head drafts
        return self.head(self._next_tokens(step), step.positions, step.aux_hidden_states, step.meta)

    def _next_tokens(self, step: DraftStep) -> torch.Tensor:
        """The step's input ids shifted by one: in each request's rows the token after, which for the rows
        from its last known token on is what the step emitted, and for a prompt chunk's last row the
        prompt's next token (rows past a sampling request's emitted tokens keep a rejected draft)."""
        shifted = step.input_ids.roll(-1)  # the last row's value, a valid id, is replaced or unused
        samplers = {id(r) for r in step.samplers}
        known = [
            (first + n - 1, r.token_ids[r.num_computed_tokens + n])
            for r, first, n in step.spans
            if id(r) not in samplers
        ]
        if known:
            known_rows = to_device([row for row, _ in known], torch.int64, self.device)
            shifted[known_rows] = to_device([token for _, token in known], torch.int64, self.device)
        if step.verified is not None:
            width = step.verified.token_ids.shape[1]
            rows: list[int] = []
            flat: list[int] = []
            for i, (t0, count) in enumerate(zip(_last_known_rows(step), step.emitted_counts)):
                rows += range(t0, t0 + count)
                flat += range(i * width, i * width + count)
            emitted = step.verified.token_ids.flatten()[to_device(flat, torch.int64, self.device)]
            shifted[to_device(rows, torch.int64, self.device)] = emitted
        return shifted

    def prefill(self, step: DraftStep) -> None:
        self.catch_up(step)

    def propose(self, step: DraftStep, k: int) -> list[list[int]]:
        """The first draft from the catch-up row at each request's last emitted token, then k - 1
        one-token steps feeding back the head's own hidden state."""
        h_normed, h_prenorm = self.catch_up(step)
        counts = step.emitted_counts
        rows = [t0 + c - 1 for t0, c in zip(_last_known_rows(step), counts)]
        index = to_device(rows, torch.int64, self.device)
        tokens, hidden = self.head.draft_tokens(h_normed[index]), h_prenorm[index]
        drafts = [tokens]
        last = [r.num_tokens - 1 + c for r, c in zip(step.samplers, counts)]
        for j in range(1, k):
            meta, pos = decode_metadata(step.samplers, [p + j - 1 for p in last], self.block_size, self.device)
            h_normed, hidden = self.head(tokens, pos, hidden, meta)
            tokens = self.head.draft_tokens(h_normed)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1).tolist()


def _last_known_rows(step: DraftStep) -> list[int]:
    """Each sampling request's flat row of its last known token (its drafts' rows follow), in sampling order."""
    first_rows = {id(r): first + n - 1 - len(r.spec_token_ids) for r, first, n in step.spans}
    return [first_rows[id(r)] for r in step.samplers]
