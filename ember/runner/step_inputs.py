"""One step's batch, flattened into the runner's host buffers (one-token queries first).

A request verifying k draft tokens is k + 1 one-token queries (its last known token, then each draft),
each attending through the request's block table up to its own position: the step stays a decode
batch, so it replays the decode CUDA graphs and takes the CPU's native decode kernels. As one
5-token prefill chunk on the CPU, a GGUF model's verify step cost ~3.5 decode steps (n-gram speed-up
1.2x at 82% acceptance), and an eager 8B verify step on the H100 2.4-4.1 decode steps.

The model sees one varlen batch: token ids, positions, cache slots, per-sequence block tables,
context lengths and query offsets, and the flat rows whose logits are sampled. Under async
scheduling a decode's input token may still be on the device (sampled by the step in flight):
its row is listed in `inflight_rows` and filled on the device from that step's sampled ids.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ember.multimodal.mrope import mrope_delta, mrope_positions
from ember.runner.input_buffers import InputBuffers
from ember.runner.request_state import RequestState
from ember.runner.step_broadcast import StepHeader


@dataclass(frozen=True)
class GraphSizes:
    """The CUDA graphs captured: decode batches by their row count, and single-request prefill chunks by
    their token count (`ember/runner/cuda_graph.py`). A step is padded up to the next captured size."""

    decode: tuple[int, ...]
    prefill: tuple[int, ...] = ()

    def decode_size(self, rows: int) -> int | None:
        return _next_size(self.decode, rows)

    def prefill_size(self, tokens: int) -> int | None:
        return _next_size(self.prefill, tokens)


class GraphKey(NamedTuple):
    """One captured CUDA graph: its size (a decode batch's rows, a lone prefill chunk's tokens), whether it
    is a prefill graph, and whether it holds the LoRA deltas (with LoRA on, each size is captured both ways)."""

    size: int
    prefill: bool
    lora: bool


def graph_key(header: StepHeader) -> GraphKey | None:
    """The graph a step replays (None: it runs eagerly). A step with a token under an adapter replays only a
    graph captured with the LoRA deltas: one without them would drop its deltas, silently."""
    return GraphKey(header.padded, bool(header.prefill_graph), bool(header.lora)) if header.padded else None


def _next_size(sizes: tuple[int, ...], n: int) -> int | None:
    i = bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


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
    # requests sampled this step, in logits-row order (1 + its drafts rows each); pooling requests never are
    samplers: list[RequestState]
    prompt_rows: list[PromptRows]
    inflight_rows: list[tuple[int, RequestState]]  # (flat row, request) whose input token is still on the device
    spans: list[tuple[RequestState, int, int]]  # (request, first flat row, tokens) of every request, in row order


def prepare_step(
    requests: list[RequestState],
    num_new_tokens: list[int],
    buffers: InputBuffers,
    block_size: int,
    graphs: GraphSizes | None,
    lora_slots: dict[int, int] | None = None,
    mrope_merge: int | None = None,
) -> PreparedStep:
    """Fill the host buffers for this step's requests, each computing its `num_new_tokens` next tokens.
    `graphs`: the captured CUDA graph sizes a decode-only batch or a lone prefill chunk is padded to
    (None: every step runs eagerly). `lora_slots`: with LoRA on, the device slot of each adapter the
    step's requests use (by lora_int_id); each token gets its request's (-1: the base model), and the
    header's `lora` says whether any request has an adapter (`graph_key`: which set of graphs it replays).
    `mrope_merge`: an M-RoPE model's spatial merge size; each token's 3D positions then fill
    `buffers.mrope_positions`."""
    decoding = [n == 1 or n == 1 + len(r.spec_token_ids) > 1 for r, n in zip(requests, num_new_tokens)]
    # Each request's adapter slot (-1: the base, or LoRA off). Decode rows go in slot order, so the LoRA
    # kernels' row tiles at large batch mostly hold one adapter each (ember/kernels/lora.py).
    adapter = [-1] * len(requests) if lora_slots is None else [_lora_slot(r, lora_slots) for r in requests]
    order = sorted(range(len(requests)), key=lambda i: (not decoding[i], adapter[i]))
    b = buffers
    ids, pos, slots = b.input_ids.np, b.positions.np, b.slot_mapping.np
    tables, seq_lens, qsl, logits_idx = b.block_tables.np, b.seq_lens.np, b.query_start_loc.np, b.logits_indices.np
    t = seq = num_decodes = max_query_len = max_seq_len = num_sample = 0
    samplers: list[RequestState] = []
    prompt_rows: list[PromptRows] = []
    inflight: list[tuple[int, RequestState]] = []
    spans: list[tuple[RequestState, int, int]] = []
    for i in order:
        req, n = requests[i], num_new_tokens[i]
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        if decoding[i]:
            # A decode, or its last known token and drafts: one one-token query each, through the same block
            # table, attending up to its own position (every layer stores a step's keys before attending).
            for j in range(n):
                tables[seq, : len(req.block_ids)] = req.block_ids
                p = start + j
                _state_row(b, seq, req, p)
                if p < req.num_tokens or j:
                    ids[t + j] = req.token_ids[p] if p < req.num_tokens else req.spec_token_ids[j - 1]
                else:
                    inflight.append((t, req))
                pos[t + j] = p
                slots[t + j] = req.block_ids[p // block_size] * block_size + p % block_size
                seq_lens[seq] = p + 1
                qsl[seq + 1] = t + j + 1
                seq += 1
            num_decodes += n
        else:
            tables[seq, : len(req.block_ids)] = req.block_ids
            _state_row(b, seq, req, start)
            max_query_len = max(max_query_len, n)
            chunk = np.arange(start, end)
            ids[t : t + n] = req.input_token_ids(start, end)
            pos[t : t + n] = chunk
            slots[t : t + n] = tables[seq, chunk // block_size] * block_size + chunk % block_size
            seq_lens[seq] = end
            qsl[seq + 1] = t + n
            seq += 1
        if req.sampling_params.prompt_logprobs is not None:
            last = min(end, req.num_prompt_tokens - 1)  # logits at position p predict prompt token p + 1
            if start < last:
                prompt_rows.append(PromptRows(req, t, start, last - start))
        spans.append((req, t, n))
        if b.token_types is not None:  # type 1 from the second text of a pair on (a cross-encoder's pair)
            second = None if req.pooling_params is None else req.pooling_params.token_type_start
            b.token_types.np[t : t + n] = 0 if second is None else np.arange(start, end) >= second
        if b.lora_slots is not None and lora_slots is not None:
            b.lora_slots.np[t : t + n] = adapter[i]
        if b.mrope_positions is not None and mrope_merge is not None:
            b.mrope_positions.np[t : t + n] = _mrope_rows(req, pos[t : t + n], mrope_merge)
        t += n
        max_seq_len = max(max_seq_len, end)
        # a sampling request past them by its drafts: a row per draft, then the bonus token's (a pooling
        # request is pooled instead, ember/runner/pooler.py)
        if end >= req.num_scheduled_tokens and req.pooling_params is None:
            rows = 1 + len(req.spec_token_ids)
            logits_idx[num_sample : num_sample + rows] = np.arange(t - rows, t)
            num_sample += rows
            samplers.append(req)
    num_seqs, num_tokens = seq, t
    padded, prefill_graph = _graph(graphs, num_seqs, num_tokens, num_decodes), False
    if padded is not None and num_decodes == num_seqs:  # pad rows write nowhere and attend to one cached token
        seq_lens[num_seqs:padded] = 1
    elif padded is not None:  # pad tokens of a lone chunk: in no sequence (query_start_loc ends at the real ones)
        prefill_graph = True
    if padded is not None:
        ids[num_tokens:padded] = 0
        pos[num_tokens:padded] = 0
        slots[num_tokens:padded] = -1
        if b.lora_slots is not None:
            b.lora_slots.np[num_tokens:padded] = -1
        if b.mrope_positions is not None:
            b.mrope_positions.np[num_tokens:padded] = 0
    header = StepHeader(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_decodes=num_decodes,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        padded=padded or 0,
        prefill_graph=prefill_graph,
        lora=any(r.lora_request is not None for r in requests),
        num_sample=num_sample,
        table_width=-(-max_seq_len // block_size),
        prompt_rows=[(r.first_row, r.count) for r in prompt_rows],
    )
    return PreparedStep(header, samplers, prompt_rows, inflight, spans)


def _lora_slot(req: RequestState, lora_slots: dict[int, int]) -> int:
    """The request's adapter slot, -1 for the base model."""
    return -1 if req.lora_request is None else lora_slots[req.lora_request.lora_int_id]


def _state_row(b: InputBuffers, seq: int, req: RequestState, first: int) -> None:
    """A linear-attention model's sequence row: the request's state slot, and whether its state starts from
    zeros (its row's first token is the request's first). Set here, once a step, so that no layer copies
    them to the device."""
    if b.state_slots is not None and b.state_fresh is not None:
        b.state_slots.np[seq] = req.state_slot
        b.state_fresh.np[seq] = first == 0


def _mrope_rows(req: RequestState, positions: np.ndarray, merge: int) -> np.ndarray:
    """[n, 3] M-RoPE positions of a request's rows at token indices `positions` (ascending): from its images
    where a row is in the prompt, else index + the prompt's delta (decodes, drafts)."""
    if req.mrope_delta is None:
        req.mrope_delta = mrope_delta(req.images, merge)
    start = int(positions[0])
    if not req.images or start >= req.num_prompt_tokens:
        return np.repeat((positions + req.mrope_delta)[:, None], 3, axis=1)
    return mrope_positions(req.images, merge, start, int(positions[-1]) + 1).T


def _graph(graphs: GraphSizes | None, num_seqs: int, num_tokens: int, num_decodes: int) -> int | None:
    """The captured graph size the step pads to: a decode-only batch by its rows, one prefill chunk by its
    tokens; None runs it eagerly."""
    if graphs is None:
        return None
    if num_decodes == num_seqs:
        return graphs.decode_size(num_seqs)
    return graphs.prefill_size(num_tokens) if num_seqs == 1 else None
