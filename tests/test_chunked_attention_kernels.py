"""Llama 4's chunked local attention in the Triton decode and prefill kernels and the PyTorch path, against
dense masked attention in float64 (tests/masked_attention.py; transformers' rule: a query at p sees keys j
with j // C == p // C and j <= p).

Keys and values before each query's chunk are overwritten with NaN in the caches the kernels read (the
reference reads clean copies), so a kernel that loads a single one of them fails: a long context costs
only the current chunk's tiles.
"""

from __future__ import annotations

import pytest
import torch
from masked_attention import check, dense_ref, poison_before, query_starts, step_metadata
from test_kernels import (  # sets TRITON_INTERPRET before ember.kernels is imported
    DEVICE,
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

CHUNKS = [1, 5, 8, 16, 37, 500]  # a single token, within one block, one block, two, not a block multiple, all


def _chunk_start(first_query: int, chunk: int) -> int:
    """The first position a query at first_query (or after it) may see: its chunk's first. The keys before it,
    poisoned, must never be loaded."""
    return first_query // chunk * chunk


DECODE_LENS = [1, 7, 8, 9, 40, 133]  # chunk edges: a query first in its chunk, last in it


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_chunk(chunk: int, num_splits: int) -> None:
    gen = torch.Generator().manual_seed(chunk)
    k_clean, v_clean, tables = paged_kv(DECODE_LENS, 8, 32, torch.float32, gen)
    q = randn(len(DECODE_LENS), NUM_KV_HEADS * 2, 32, gen=gen)
    k_cache, v_cache = k_clean, v_clean
    for b, n in enumerate(DECODE_LENS):
        k_cache, v_cache = poison_before(k_cache, v_cache, tables[b], _chunk_start(n - 1, chunk))
    lens = as_int32(DECODE_LENS)

    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2, num_splits=num_splits, attention_chunk=chunk)
    ref = paged_decode_attention_ref(q, k_clean, v_clean, tables, lens, 0.2, attention_chunk=chunk)

    for b, n in enumerate(DECODE_LENS):
        expected = dense_ref(q[b : b + 1], k_clean, v_clean, tables[b], n, 0.2, chunk=chunk)
        check(out[b : b + 1], expected, torch.float32)
        check(ref[b : b + 1], expected, torch.float32)


# (cached context, new tokens): fresh prompts, one-token chunks, prefill chunks over cached prefixes that
# start mid-chunk, a sequence with no queries this step
PREFILL_CHUNKS = [(0, 1), (0, 23), (9, 1), (30, 17), (100, 3), (15, 0), (70, 40), (5, 2)]


def run_prefill(
    chunk: int, *, group: int = 2, block_size: int = 16, dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None, head_dim: int = 32, chunks: list[tuple[int, int]] = PREFILL_CHUNKS,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(chunk + group)
    cache_dtype = cache_dtype or dtype
    seq_lens = [c + n for c, n in chunks]
    k_clean, v_clean, tables = paged_kv(seq_lens, block_size, head_dim, cache_dtype, gen)
    starts = query_starts(chunks)
    q = randn(starts[-1], NUM_KV_HEADS * group, head_dim, gen=gen, dtype=dtype)
    scales = kv_scales(cache_dtype)
    k_cache, v_cache = k_clean, v_clean
    for b, (ctx, _) in enumerate(chunks):
        k_cache, v_cache = poison_before(k_cache, v_cache, tables[b], _chunk_start(ctx, chunk))
    lens, locs, max_q = as_int32(seq_lens), as_int32(starts), max(n for _, n in chunks)

    out = paged_prefill_attention(q, k_cache, v_cache, tables, lens, locs, max_q, 0.2, **scales, attention_chunk=chunk)
    ref = paged_prefill_attention_ref(
        q, k_clean, v_clean, tables, lens, locs, max_q, 0.2, **scales, attention_chunk=chunk
    )

    for b, n in enumerate(seq_lens):
        rows = slice(starts[b], starts[b + 1])
        expected = dense_ref(q[rows], k_clean, v_clean, tables[b], n, 0.2, chunk=chunk, **scales)
        check(out[rows], expected, dtype)
        check(ref[rows], expected, dtype)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_prefill_chunk(chunk: int) -> None:
    run_prefill(chunk)


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_chunk_gqa_and_small_blocks(group: int) -> None:
    """group 1: 128-query tiles over 13-token chunks, so a tile's rows start in many different chunks."""
    run_prefill(13, group=group, block_size=8, chunks=[(0, 100), (30, 90), (7, 2)])


def test_prefill_chunk_fp8_cache() -> None:
    run_prefill(16, dtype=torch.bfloat16, cache_dtype=FP8, head_dim=64)


@pytest.mark.parametrize("bad", [{"attention_chunk": 0}, {"attention_chunk": 2.5}])
def test_bad_chunk_is_a_clear_error(bad: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables = paged_kv([5], 16, 32, torch.float32, gen)
    q = randn(1, NUM_KV_HEADS, 32, gen=gen)
    with pytest.raises(ValueError, match="attention_chunk"):
        paged_decode_attention(q, k_cache, v_cache, tables, as_int32([5]), 0.125, **bad)
    with pytest.raises(ValueError, match="attention_chunk"):
        paged_prefill_attention(q, k_cache, v_cache, tables, as_int32([5]), as_int32([0, 1]), 1, 0.125, **bad)
    with pytest.raises(ValueError, match="one or the other"):
        paged_decode_attention(q, k_cache, v_cache, tables, as_int32([5]), 0.125, sliding_window=4, attention_chunk=8)


@pytest.mark.parametrize("triton", [True, False])
def test_model_attention_forwards_the_chunk(monkeypatch, triton: bool) -> None:
    """A step as the engine lays it out (two decodes, then a fresh prompt and a chunk over a cached prefix)
    through paged_attention, on the kernel path and on the PyTorch path: each row sees its own chunk."""
    monkeypatch.setattr(backend, "FORCE_TRITON", triton)
    if not triton and DEVICE != "cpu":
        pytest.skip("the PyTorch path's check runs on CPU")
    gen = torch.Generator().manual_seed(9)
    chunks = [(30, 1), (63, 1), (0, 25), (37, 12)]
    seq_lens = [c + n for c, n in chunks]
    k_cache, v_cache, tables = paged_kv(seq_lens, 8, 32, torch.float32, gen)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()  # the PyTorch path gathers whole blocks
    starts = query_starts(chunks)
    q = randn(starts[-1], NUM_KV_HEADS * 2, 32, gen=gen) * 3
    meta = step_metadata(chunks, tables, num_decodes=2)

    out = paged_attention(q, k_cache, v_cache, meta, 0.2, attention_chunk=10)

    for b, n in enumerate(seq_lens):
        rows = slice(starts[b], starts[b + 1])
        check(out[rows], dense_ref(q[rows], k_cache, v_cache, tables[b], n, 0.2, chunk=10), torch.float32)
