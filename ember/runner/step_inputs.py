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


@dataclass
class VerifyGraphs:
    """Captured verify graphs: `size(num_seqs)` the batch size to pad to (None: none fits), each
    sequence padded to `query_len` tokens."""

    size: Callable[[int], int | None]
    query_len: int


def prepare_step(
    requests: list[RequestState],
    num_new_tokens: list[int],
    buffers: InputBuffers,
    block_size: int,
    graph_size: Callable[[int], int | None] | None,
    verify: VerifyGraphs | None = None,
) -> PreparedStep:
    """Fill the host buffers for this step's requests, each computing its `num_new_tokens` next tokens.
    `graph_size(num_seqs)` gives the captured CUDA graph size to pad a decode-only batch to (None: run
    eagerly); `verify`, the graphs a batch of decodes with drafts is padded to."""
    if verify is not None and any(r.spec_token_ids for r in requests):
        padded = verify.size(len(requests))
        if padded is not None and _uniform_verify(requests, num_new_tokens, verify.query_len):
            return _prepare_verify(requests, buffers, block_size, padded, verify.query_len)
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


def _uniform_verify(requests: list[RequestState], num_new_tokens: list[int], query_len: int) -> bool:
    """Every request computes its last known token and its drafts, at most `query_len` tokens."""
    return all(
        n == 1 + len(r.spec_token_ids) <= query_len
        and r.num_computed_tokens + 1 == r.num_tokens
        and not r.num_inflight_tokens
        for r, n in zip(requests, num_new_tokens)
    )


def _prepare_verify(
    requests: list[RequestState], buffers: InputBuffers, block_size: int, padded: int, query_len: int
) -> PreparedStep:
    """A verify graph's inputs: sequence r's rows are r * query_len ..., its last known token, its drafts,
    then padding that writes nowhere (slot -1) and is never sampled; padding sequences up to `padded`
    likewise. Every row attends through its sequence's table (block 0 past the allocated blocks)."""
    b, q = buffers, query_len
    ids, pos, slots = b.input_ids.np, b.positions.np, b.slot_mapping.np
    tables, seq_lens, qsl, logits_idx = b.block_tables.np, b.seq_lens.np, b.query_start_loc.np, b.logits_indices.np
    width = 0
    num_sample = 0
    spans: list[tuple[RequestState, int, int]] = []
    offsets = np.arange(q)
    for row, req in enumerate(requests):
        t, start, n = row * q, req.num_computed_tokens, 1 + len(req.spec_token_ids)
        blocks = len(req.block_ids)
        need = -(-(start + q) // block_size)
        tables[row, :blocks] = req.block_ids
        tables[row, blocks:need] = 0
        width = max(width, need)
        p = start + offsets
        ids[t : t + q] = 0
        ids[t : t + n] = [req.token_ids[start], *req.spec_token_ids]
        pos[t : t + q] = p
        slots[t : t + q] = np.where(offsets < n, tables[row, p // block_size] * block_size + p % block_size, -1)
        seq_lens[row] = start + q
        logits_idx[num_sample : num_sample + n] = np.arange(t, t + n)
        num_sample += n
        spans.append((req, t, n))
    num_seqs = len(requests)
    ids[num_seqs * q : padded * q] = 0
    pos[num_seqs * q : padded * q] = np.tile(offsets, padded - num_seqs)
    slots[num_seqs * q : padded * q] = -1
    seq_lens[num_seqs:padded] = q
    tables[num_seqs:padded, :width] = 0
    qsl[: padded + 1] = np.arange(padded + 1) * q
    header = StepHeader(
        num_tokens=num_seqs * q,
        num_seqs=num_seqs,
        num_decodes=0,
        max_query_len=q,
        max_seq_len=int(seq_lens[:num_seqs].max()),
        padded=padded,
        num_sample=num_sample,
        table_width=width,
        query_len=q,
    )
    return PreparedStep(header, list(requests), [], [], spans)
