"""Sliding-window attention and logit soft-capping in the Triton decode and prefill kernels, against
dense masked attention in float64 (tests/masked_attention.py; HF's rule: a query at p sees
p - window < j <= p; a capped score is cap * tanh(s / cap), before masking).

Keys and values left of every query's window are overwritten with NaN in the caches the kernels
read (the reference reads clean copies), so a kernel that loads a single one of them, masked or
not, fails: this is what shows a long context with a small window costs only the window's tiles.
"""

from __future__ import annotations

import pytest
import torch
from masked_attention import check, dense_ref, poison_before, query_starts, replay_decode_graph, step_metadata
from test_kernels import (  # sets TRITON_INTERPRET before ember.kernels is imported
    FP8,
    NUM_KV_HEADS,
    as_int32,
    kv_scales,
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


def _window_start(first_query: int, window: int | None) -> int:
    """The first position a query at first_query (or after it) may see: the keys before it, poisoned, must
    never be loaded."""
    return 0 if window is None else first_query - window + 1


# ---------------------------------------------------------------- decode

DECODE_LENS = [1, 7, 40, 70, 133]
WINDOWS = [1, 5, 16, 37, 70, 500]  # a single token, within one block, one block, not a block multiple,
# equal to one context, longer than every context


def run_decode(
    window: int | None,
    cap: float | None,
    *,
    block_size: int = 16,
    group: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    num_splits: int | None = 1,
    q_gain: float = 1.0,
) -> None:
    gen = torch.Generator().manual_seed(1000 * (window or 0) + group * 10 + block_size)
    cache_dtype = cache_dtype or dtype
    k_clean, v_clean, tables = paged_kv(DECODE_LENS, block_size, head_dim, cache_dtype, gen)
    q = randn(len(DECODE_LENS), NUM_KV_HEADS * group, head_dim, gen=gen, dtype=dtype) * q_gain
    scale, scales = head_dim**-0.5, kv_scales(cache_dtype)
    k_cache, v_cache = k_clean, v_clean
    for b, n in enumerate(DECODE_LENS):  # blocks are private to a sequence, so poisoning one touches no other
        k_cache, v_cache = poison_before(k_cache, v_cache, tables[b], _window_start(n - 1, window))
    splits = {"num_splits": None, "max_seq_len": 1024} if num_splits is None else {"num_splits": num_splits}

    out = paged_decode_attention(
        q,
        k_cache,
        v_cache,
        tables,
        as_int32(DECODE_LENS),
        scale,
        **splits,
        **scales,
        sliding_window=window,
        logits_soft_cap=cap,
    )

    for b, n in enumerate(DECODE_LENS):
        check(
            out[b : b + 1],
            dense_ref(q[b : b + 1], k_clean, v_clean, tables[b], n, scale, window=window, cap=cap, **scales),
            dtype,
        )


@pytest.mark.parametrize("window", WINDOWS)
def test_decode_window(window: int) -> None:
    run_decode(window, None)


@pytest.mark.parametrize("num_splits", [3, None])
def test_decode_window_split_over_the_window(num_splits: int | None) -> None:
    run_decode(37, None, num_splits=num_splits, block_size=8, group=4)


@pytest.mark.parametrize("window", [None, 37])
def test_decode_soft_cap(window: int | None) -> None:
    # q scaled up so raw scores reach several times the cap and the tanh bends them.
    run_decode(window, 2.5, q_gain=4.0, group=1, num_splits=None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_window_and_cap_fp8_cache(dtype: torch.dtype) -> None:
    run_decode(16, 5.0, dtype=dtype, cache_dtype=FP8, head_dim=64, q_gain=3.0, num_splits=None)


def test_decode_window_bf16() -> None:
    run_decode(5, None, dtype=torch.bfloat16, block_size=8, group=3)


# ---------------------------------------------------------------- prefill

# (cached context, new tokens): fresh prompts, one-token chunks, chunks over long cached prefixes,
# a sequence with no queries this step, and a two-token chunk, whose second query's window edge is
# one past its first's (the smallest window-masked strip).
PREFILL_CHUNKS = [(0, 1), (0, 23), (9, 1), (30, 17), (100, 3), (15, 0), (70, 40), (50, 2)]


def run_prefill(
    window: int | None,
    cap: float | None,
    *,
    block_size: int = 16,
    group: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    q_gain: float = 1.0,
    chunks: list[tuple[int, int]] = PREFILL_CHUNKS,
) -> None:
    gen = torch.Generator().manual_seed(1000 * (window or 0) + group * 10 + block_size + 1)
    cache_dtype = cache_dtype or dtype
    seq_lens = [c + n for c, n in chunks]
    k_clean, v_clean, tables = paged_kv(seq_lens, block_size, head_dim, cache_dtype, gen)
    starts = query_starts(chunks)
    q = randn(starts[-1], NUM_KV_HEADS * group, head_dim, gen=gen, dtype=dtype) * q_gain
    scale, scales = head_dim**-0.5, kv_scales(cache_dtype)
    k_cache, v_cache = k_clean, v_clean
    for b, (ctx, _) in enumerate(chunks):
        k_cache, v_cache = poison_before(k_cache, v_cache, tables[b], _window_start(ctx, window))
    max_q = max(n for _, n in chunks)

    out = paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        tables,
        as_int32(seq_lens),
        as_int32(starts),
        max_q,
        scale,
        **scales,
        sliding_window=window,
        logits_soft_cap=cap,
    )

    for b, n in enumerate(seq_lens):
        rows = slice(starts[b], starts[b + 1])
        check(
            out[rows],
            dense_ref(q[rows], k_clean, v_clean, tables[b], n, scale, window=window, cap=cap, **scales),
            dtype,
        )


@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_window(window: int) -> None:
    run_prefill(window, None)


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_window_gqa_and_small_blocks(group: int) -> None:
    run_prefill(13, None, group=group, block_size=8)


def test_prefill_window_narrower_than_a_query_tile() -> None:
    """128-query tiles (one head per KV head) over a 13-token window: a tile's last queries see
    nothing in its first key tile, so their running max is still -inf there."""
    run_prefill(13, None, group=1, chunks=[(0, 100), (30, 90)])


@pytest.mark.parametrize("window", [None, 20])
def test_prefill_soft_cap(window: int | None) -> None:
    run_prefill(window, 2.5, q_gain=4.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_window_and_cap_fp8_cache(dtype: torch.dtype) -> None:
    run_prefill(16, 5.0, dtype=dtype, cache_dtype=FP8, head_dim=64, q_gain=3.0)


def test_refs_follow_the_same_rule() -> None:
    """The kernels' *_ref twins (float32) agree with the float64 dense reference."""
    gen = torch.Generator().manual_seed(5)
    seq_lens, window, cap = [9, 40], 11, 3.0
    k_cache, v_cache, tables = paged_kv(seq_lens, 8, 32, torch.float32, gen)
    q = randn(2, NUM_KV_HEADS * 2, 32, gen=gen) * 3
    lens = as_int32(seq_lens)
    decode = paged_decode_attention_ref(
        q, k_cache, v_cache, tables, lens, 0.2, sliding_window=window, logits_soft_cap=cap
    )
    prefill = paged_prefill_attention_ref(
        q, k_cache, v_cache, tables, lens, as_int32([0, 1, 2]), 1, 0.2, sliding_window=window, logits_soft_cap=cap
    )
    for b, n in enumerate(seq_lens):
        expected = dense_ref(q[b : b + 1], k_cache, v_cache, tables[b], n, 0.2, window=window, cap=cap)
        check(decode[b : b + 1], expected, torch.float32)
        check(prefill[b : b + 1], expected, torch.float32)


@pytest.mark.parametrize(
    "bad", [{"sliding_window": 0}, {"sliding_window": 2.5}, {"logits_soft_cap": 0.0}, {"logits_soft_cap": -1.0}]
)
def test_bad_window_or_cap_is_a_clear_error(bad: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables = paged_kv([5], 16, 32, torch.float32, gen)
    q = randn(1, NUM_KV_HEADS, 32, gen=gen)
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        paged_decode_attention(q, k_cache, v_cache, tables, as_int32([5]), 0.125, **bad)
    with pytest.raises(ValueError, match=name):
        paged_prefill_attention(q, k_cache, v_cache, tables, as_int32([5]), as_int32([0, 1]), 1, 0.125, **bad)


# ---------------------------------------------------------------- through ember.model.attention


def test_model_attention_forwards_window_and_cap_to_both_kernels(monkeypatch) -> None:
    """A step as the engine lays it out (two decodes, then a fresh prompt and a chunk over a cached
    prefix) through paged_attention on the kernel path: each row is windowed and capped."""
    monkeypatch.setattr(backend, "FORCE_TRITON", True)
    gen = torch.Generator().manual_seed(9)
    chunks = [(30, 1), (60, 1), (0, 25), (40, 12)]
    seq_lens = [c + n for c, n in chunks]
    k_cache, v_cache, tables = paged_kv(seq_lens, 8, 32, torch.float32, gen)
    starts = query_starts(chunks)
    q = randn(starts[-1], NUM_KV_HEADS * 2, 32, gen=gen) * 3
    meta = step_metadata(chunks, tables, num_decodes=2)
    window, cap = 10, 4.0

    out = paged_attention(q, k_cache, v_cache, meta, 0.2, sliding_window=window, logits_soft_cap=cap)

    for b, n in enumerate(seq_lens):
        rows = slice(starts[b], starts[b + 1])
        check(out[rows], dense_ref(q[rows], k_cache, v_cache, tables[b], n, 0.2, window=window, cap=cap), torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (gpu_suite.sh's kernels stage)")
def test_windowed_and_capped_decode_replay_in_one_cuda_graph() -> None:
    """As the runner captures decode: one graph over several layers, each with its own window and
    cap, replayed after the sequence lengths changed in place."""
    gen = torch.Generator().manual_seed(4)
    capacity = [40, 133, 7]
    k_cache, v_cache, tables = paged_kv(capacity, 16, 64, torch.bfloat16, gen)
    q = randn(len(capacity), NUM_KV_HEADS * 2, 64, gen=gen, dtype=torch.bfloat16) * 3
    layers = [(16, None), (None, 5.0), (37, 5.0)]
    new_lens = [33, 120, 5]
    masks = [{"sliding_window": window, "logits_soft_cap": cap} for window, cap in layers]

    outs = replay_decode_graph(q, k_cache, v_cache, tables, 0.125, masks, capacity, new_lens)

    for (window, cap), out in zip(layers, outs):
        for b, n in enumerate(new_lens):
            check(
                out[b : b + 1],
                dense_ref(q[b : b + 1], k_cache, v_cache, tables[b], n, 0.125, window=window, cap=cap),
                torch.bfloat16,
            )
