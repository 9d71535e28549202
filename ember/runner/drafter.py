"""Draft models inside the step: a smaller model of the same vocabulary (`draft_model`) proposes the next
step's drafts right after the target has verified this step's.

The draft model has its own KV tensors for the same blocks as the target's (the scheduler's block
tables serve both; a block's bytes count both models), so each step first runs it over the step's
own tokens (`catch_up`: its KV for every position the target computed, rejected drafts' slots
included, which later steps overwrite), then k one-token steps from each request's last emitted
token, each taking the argmax: drafts are greedy, and verification treats them as one-hot
(ember/sampling/rejection.py), so the output is exact whatever they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ember.model.llama import CausalLM
from ember.ops.attention import AttentionMetadata
from ember.runner.kv_cache import KVCache
from ember.runner.request_state import RequestState
from ember.transfer import array_to_device


@dataclass
class Proposal:
    """Where each sampling request's proposal starts: its last emitted token (on the device) and that
    token's position, in sampling-row order."""

    requests: list[RequestState]
    last_tokens: torch.Tensor  # [N] int64
    last_positions: list[int]


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

    def catch_up(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The draft model's KV for the step's tokens: the same inputs, slots and block tables."""
        self.model(input_ids, positions, meta)

    def propose(self, proposal: Proposal, k: int) -> list[list[int]]:
        """k greedy drafts per request, continuing from its last emitted token."""
        tokens, drafts = proposal.last_tokens, []
        for j in range(k):
            positions = [p + j for p in proposal.last_positions]
            meta, pos = decode_metadata(proposal.requests, positions, self.block_size, self.device)
            tokens = self.model.greedy_tokens(self.model(tokens, pos, meta))
            drafts.append(tokens)
        return torch.stack(drafts, dim=1).tolist()
