"""Attention sinks (gpt-oss): one learned logit per query head that joins every softmax denominator
and carries no value. The Triton decode and prefill kernels (through the interpreter), the engine's
PyTorch path and the float32 reference all against float64 attention (tests/masked_attention.py), with
and without a sliding window, and with the decode context split over several programs (the sink joins once).
"""

from __future__ import annotations

import pytest
import torch
from masked_attention import check, dense_ref, query_starts, replay_decode_graph, step_metadata
from test_kernels import (  # sets TRITON_INTERPRET before ember.kernels is imported
    DEVICE,
    NUM_KV_HEADS,
    as_int32,
    paged_kv,
    randn,
)

from ember.kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from ember.ops import registry as backend
from ember.ops.functional import paged_attention

GROUP, HEAD_DIM, BLOCK = 2, 32, 8
NUM_HEADS = NUM_KV_HEADS * GROUP


def _sinks(gen: torch.Generator) -> torch.Tensor:
    """Sinks from well below to well above the scores (|s| ~ 1): from no effect to most of the mass."""
    return (torch.randn(NUM_HEADS, generator=gen) * 2).to(DEVICE)


DECODE_LENS = [1, 7, 40, 133]


@pytest.mark.parametrize("window,num_splits", [(None, 1), (None, 3), (16, 1), (37, 2)])
@pytest.mark.parametrize("fn", ["kernel", "ref"])
def test_decode_with_sinks(window, num_splits, fn):
    gen = torch.Generator().manual_seed(7 + (window or 0) + num_splits)
    k_cache, v_cache, tables = paged_kv(DECODE_LENS, BLOCK, HEAD_DIM, torch.float32, gen)
    q = randn(len(DECODE_LENS), NUM_HEADS, HEAD_DIM, gen=gen)
    sinks = _sinks(gen)
    attend = paged_decode_attention if fn == "kernel" else paged_decode_attention_ref
    out = attend(
        q,
        k_cache,
        v_cache,
        tables,
        as_int32(DECODE_LENS),
        HEAD_DIM**-0.5,
        num_splits=num_splits,
        sliding_window=window,
        sinks=sinks,
    )
    for b, n in enumerate(DECODE_LENS):
        check(
            out[b : b + 1],
            dense_ref(q[b : b + 1], k_cache, v_cache, tables[b], n, HEAD_DIM**-0.5, window=window, sinks=sinks),
            torch.float32,
        )


# (cached context, new tokens), as in tests/test_sliding_window_kernels.py, with a sequence of no queries
PREFILL_CHUNKS = [(0, 1), (0, 23), (9, 1), (30, 17), (15, 0), (50, 2)]


@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("fn", ["kernel", "ref"])
def test_prefill_with_sinks(window, fn):
    gen = torch.Generator().manual_seed(11 + (window or 0))
    seq_lens = [c + n for c, n in PREFILL_CHUNKS]
    k_cache, v_cache, tables = paged_kv(seq_lens, BLOCK, HEAD_DIM, torch.float32, gen)
    starts = query_starts(PREFILL_CHUNKS)
    q = randn(starts[-1], NUM_HEADS, HEAD_DIM, gen=gen)
    sinks = _sinks(gen)
    attend = paged_prefill_attention if fn == "kernel" else paged_prefill_attention_ref
    out = attend(
        q,
        k_cache,
        v_cache,
        tables,
        as_int32(seq_lens),
        as_int32(starts),
        max(n for _, n in PREFILL_CHUNKS),
        HEAD_DIM**-0.5,
        sliding_window=window,
        sinks=sinks,
    )
    for b, n in enumerate(seq_lens):
        rows = slice(starts[b], starts[b + 1])
        check(
            out[rows],
            dense_ref(q[rows], k_cache, v_cache, tables[b], n, HEAD_DIM**-0.5, window=window, sinks=sinks),
            torch.float32,
        )


@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_engine_attention_with_sinks(window, path, monkeypatch):
    """paged_attention over a mixed batch (two decodes, then two prefill chunks, one over a cached
    prefix), on the CPU path and on the kernels."""
    monkeypatch.setattr(backend, "FORCE_TRITON", path == "triton")
    gen = torch.Generator().manual_seed(3 + (window or 0))
    chunks = [(40, 1), (6, 1), (0, 19), (25, 9)]  # (cached context, new tokens), decodes first
    seq_lens = [c + n for c, n in chunks]
    k_cache, v_cache, tables = paged_kv(seq_lens, BLOCK, HEAD_DIM, torch.float32, gen)
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)  # the CPU path gathers whole blocks
    starts = query_starts(chunks)
    q = randn(starts[-1], NUM_HEADS, HEAD_DIM, gen=gen)
    sinks = _sinks(gen)
    meta = step_metadata(chunks, tables, num_decodes=2)
    out = paged_attention(q, k_cache, v_cache, meta, HEAD_DIM**-0.5, sliding_window=window, sinks=sinks)
    for b, n in enumerate(seq_lens):
        rows = slice(starts[b], starts[b + 1])
        check(
            out[rows],
            dense_ref(q[rows], k_cache, v_cache, tables[b], n, HEAD_DIM**-0.5, window=window, sinks=sinks),
            torch.float32,
        )


def test_bad_sinks_are_a_clear_error():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables = paged_kv([5], BLOCK, HEAD_DIM, torch.float32, gen)
    q = randn(1, NUM_HEADS, HEAD_DIM, gen=gen)
    with pytest.raises(ValueError, match="sinks must be a contiguous float32 tensor"):
        paged_decode_attention(
            q, k_cache, v_cache, tables, as_int32([5]), 1.0, sinks=torch.zeros(NUM_HEADS + 1, device=DEVICE)
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (gpu_suite.sh's kernels stage)")
def test_sinks_replay_in_a_cuda_graph():
    """As the runner captures decode: a sliding layer and a full one, each with its own sinks, replayed
    after the sequence lengths and the sinks changed in place (the sinks are read on the device)."""
    gen = torch.Generator().manual_seed(4)
    capacity = [40, 133, 7]
    k_cache, v_cache, tables = paged_kv(capacity, BLOCK, HEAD_DIM, torch.float32, gen)
    q = randn(len(capacity), NUM_HEADS, HEAD_DIM, gen=gen)
    layers = [(16, _sinks(gen)), (None, _sinks(gen))]
    new_lens = [33, 120, 5]

    def new_sinks() -> None:
        for _, sinks in layers:
            sinks.copy_(_sinks(gen))

    masks = [{"sliding_window": window, "sinks": sinks} for window, sinks in layers]
    outs = replay_decode_graph(q, k_cache, v_cache, tables, HEAD_DIM**-0.5, masks, capacity, new_lens, new_sinks)
    for (window, sinks), out in zip(layers, outs):
        for b, n in enumerate(new_lens):
            check(
                out[b : b + 1],
                dense_ref(q[b : b + 1], k_cache, v_cache, tables[b], n, HEAD_DIM**-0.5, window=window, sinks=sinks),
                torch.float32,
            )
