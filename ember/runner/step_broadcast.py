"""Rank 0 tells the other tensor-parallel ranks what each step computes: a few integers and the
flat batch arrays, two broadcasts over the host (gloo) group. No request objects are pickled; the
other ranks never see requests, only the token ids, positions, slots and block tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch
import torch.distributed as dist

from ember.distributed import host_group
from ember.runner.input_buffers import InputBuffers

_STOP, _STEP = 0, 1


@dataclass
class StepHeader:
    num_tokens: int
    num_seqs: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    padded: int  # CUDA graph size to replay (decode rows, or a lone prefill chunk's tokens), 0 for an eager forward
    num_sample: int  # rows whose logits are computed for sampling
    table_width: int  # block-table columns in use
    prefill_graph: bool = False  # `padded` names a prefill graph: one sequence, `padded` tokens
    lora: bool = False  # a token runs under a LoRA adapter: a graph replayed must hold the deltas
    # per request wanting prompt logprobs: (first flat row, number of rows)
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.num_seqs if self.prefill_graph else self.padded or self.num_seqs

    @property
    def tokens(self) -> int:
        return self.padded or self.num_tokens


_SCALARS = [f.name for f in fields(StepHeader) if f.name != "prompt_rows"]
_HEADER_LEN = 2 + len(_SCALARS)  # kind, the scalars, number of prompt-row pairs


def _payload_parts(h: StepHeader, b: InputBuffers) -> list[np.ndarray]:
    """Views of the host buffers a step reads, in the order they travel."""
    mrope = [] if b.mrope_positions is None else [b.mrope_positions.np[: h.tokens]]
    return [
        b.input_ids.np[: h.tokens],
        b.positions.np[: h.tokens],
        b.slot_mapping.np[: h.tokens],
        b.seq_lens.np[: h.rows],
        b.query_start_loc.np[: h.num_seqs + 1],
        b.logits_indices.np[: h.num_sample],
        b.block_tables.np[: h.rows, : h.table_width],
        *mrope,
    ]


def _broadcast(t: torch.Tensor) -> None:
    dist.broadcast(t, src=0, group=host_group())


def send_step(h: StepHeader, buffers: InputBuffers) -> None:
    header = [_STEP] + [getattr(h, name) for name in _SCALARS] + [len(h.prompt_rows)]
    _broadcast(torch.tensor(header, dtype=torch.int64))
    parts = [p.reshape(-1).astype(np.int64) for p in _payload_parts(h, buffers)]
    parts.append(np.asarray(h.prompt_rows, dtype=np.int64).reshape(-1))
    _broadcast(torch.from_numpy(np.concatenate(parts)))


def send_stop() -> None:
    _broadcast(torch.zeros(_HEADER_LEN, dtype=torch.int64))


def receive_step(buffers: InputBuffers) -> StepHeader | None:
    """The next step, its arrays written into `buffers`' host side; None when rank 0 stops."""
    header = torch.empty(_HEADER_LEN, dtype=torch.int64)
    _broadcast(header)
    values = header.tolist()
    if values[0] == _STOP:
        return None
    h = StepHeader(**dict(zip(_SCALARS, values[1:-1])))
    parts = _payload_parts(h, buffers)
    sizes = [p.size for p in parts] + [2 * values[-1]]
    payload = torch.empty(sum(sizes), dtype=torch.int64)
    _broadcast(payload)
    flat = payload.numpy()
    offset = 0
    for part, size in zip(parts, sizes):
        part[...] = flat[offset : offset + size].reshape(part.shape)
        offset += size
    h.prompt_rows = [tuple(pair) for pair in flat[offset:].reshape(-1, 2).tolist()]
    return h
