"""One step's batch, flattened into the runner's host buffers (one-token queries first).

The model sees one varlen batch: token ids, positions, cache slots, per-sequence block tables,
context lengths and query offsets, and the flat rows whose logits are sampled. Under async
scheduling a decode's input token may still be on the device (sampled by the step in flight):
its row is listed in `inflight_rows` and filled on the device from that step's sampled ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ember.runner.input_buffers import InputBuffers
from ember.runner.request_state import RequestState
from ember.runner.step_broadcast import StepHeader


@dataclass
class PromptRows:
    """A request's prompt positions whose logits give prompt logprobs in this step."""

    request: RequestState
    first_row: int  # flat token row of the first position
    start: int  # its position: the logits there predict prompt token start + 1
    count: int


@dataclass
class PreparedStep:
    header: StepHeader
    samplers: list[RequestState]  # requests sampled this step, in logits-row order (1 + its drafts rows each)
    prompt_rows: list[PromptRows]
    inflight_rows: list[tuple[int, RequestState]]  # (flat row, request) whose input token is still on the device
    spans: list[tuple[RequestState, int, int]]  # (request, first flat row, tokens) of every request, in row order


def prepare_step(
    requests: list[RequestState],
    num_new_tokens: list[int],
    buffers: InputBuffers,
    block_size: int,
    graph_size: Callable[[int], int | None] | None,
) -> PreparedStep:
    """Fill the host buffers for this step's requests, each computing its `num_new_tokens` next tokens.
    `graph_size(num_seqs)` gives the captured CUDA graph size to pad a decode-only batch to (None: run
    eagerly)."""
    order = sorted(range(len(requests)), key=lambda i: num_new_tokens[i] != 1)
    b = buffers
    ids, pos, slots = b.input_ids.np, b.positions.np, b.slot_mapping.np
    tables, seq_lens, qsl, logits_idx = b.block_tables.np, b.seq_lens.np, b.query_start_loc.np, b.logits_indices.np
    t = num_decodes = max_query_len = max_seq_len = num_sample = 0
    samplers: list[RequestState] = []
    prompt_rows: list[PromptRows] = []
    inflight: list[tuple[int, RequestState]] = []
    spans: list[tuple[RequestState, int, int]] = []
    for row, i in enumerate(order):
        req, n = requests[i], num_new_tokens[i]
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        tables[row, : len(req.block_ids)] = req.block_ids
        if n == 1:
            num_decodes += 1
            if start < req.num_tokens:
                ids[t] = req.token_ids[start]
            else:
                inflight.append((t, req))
            pos[t] = start
            slots[t] = req.block_ids[start // block_size] * block_size + start % block_size
        else:
            max_query_len = max(max_query_len, n)
            p = np.arange(start, end)
            ids[t : t + n] = req.input_token_ids(start, end)
            pos[t : t + n] = p
            slots[t : t + n] = tables[row, p // block_size] * block_size + p % block_size
        if req.sampling_params.prompt_logprobs is not None:
            last = min(end, req.num_prompt_tokens - 1)  # logits at position p predict prompt token p + 1
            if start < last:
                prompt_rows.append(PromptRows(req, t, start, last - start))
        spans.append((req, t, n))
        t += n
        seq_lens[row] = end
        qsl[row + 1] = t
        max_seq_len = max(max_seq_len, end)
        if end >= req.num_scheduled_tokens:  # past them by its drafts: a row per draft, then the bonus token's
            rows = 1 + len(req.spec_token_ids)
            logits_idx[num_sample : num_sample + rows] = np.arange(t - rows, t)
            num_sample += rows
            samplers.append(req)
    num_seqs, num_tokens = len(order), t
    padded = graph_size(num_seqs) if graph_size is not None and num_decodes == num_seqs else None
    if padded is not None:  # pad rows write nowhere and attend to one cached token
        ids[num_tokens:padded] = 0
        pos[num_tokens:padded] = 0
        slots[num_tokens:padded] = -1
        seq_lens[num_seqs:padded] = 1
    header = StepHeader(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_decodes=num_decodes,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        padded=padded or 0,
        num_sample=num_sample,
        table_width=-(-max_seq_len // block_size),
        prompt_rows=[(r.first_row, r.count) for r in prompt_rows],
    )
    return PreparedStep(header, samplers, prompt_rows, inflight, spans)
