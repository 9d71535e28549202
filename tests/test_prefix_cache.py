"""Prefix caching: same outputs with and without it, hits on shared prefixes, no leaked blocks."""

from __future__ import annotations

import random

import pytest
from conftest import DEVICE

from ember import LLM, SamplingParams
from ember.core.block_manager import BlockManager
from ember.core.request import Request


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=4),
        max_tokens=4,
        eos_token_ids=[],
        arrival_time=0.0,
    )


def test_outputs_identical_with_and_without_prefix_caching(llama_dir):
    rng = random.Random(3)
    system = [rng.randint(5, 511) for _ in range(70)]
    prompts = [
        {"prompt_token_ids": system + [rng.randint(5, 511) for _ in range(rng.randint(1, 40))]} for _ in range(12)
    ]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = {}
    for enabled in (False, True):
        llm = LLM(str(llama_dir), kv_cache_memory=0.05, enable_prefix_caching=enabled, device=DEVICE, dtype="float32")
        # Two rounds: the second round finds the first round's blocks in the cache.
        stats = llm.llm_engine.scheduler_stats
        first = llm.generate(prompts, params, use_tqdm=False)
        hits_first = stats().prefix_cache_hits
        second = llm.generate(prompts, params, use_tqdm=False)
        results[enabled] = ([o.outputs[0].token_ids for o in first], [o.outputs[0].token_ids for o in second])
        assert stats().kv_cache_usage == 0.0
        if enabled:
            assert stats().prefix_cache_hits - hits_first >= 12 * 64  # at least the 4 shared blocks each
            assert all(o.num_cached_tokens >= 64 for o in second)
        else:
            assert stats().prefix_cache_hits == 0
    assert results[True] == results[False]
    assert results[True][0] == results[True][1]


def test_hit_counter_rises_on_shared_prefix(llama_dir):
    llm = LLM(str(llama_dir), kv_cache_memory=0.05)
    stats = llm.llm_engine.scheduler_stats
    shared = list(range(10, 10 + 48))
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([{"prompt_token_ids": shared + [7]}], params, use_tqdm=False)
    assert stats().prefix_cache_hits == 0
    queries = stats().prefix_cache_queries
    out = llm.generate([{"prompt_token_ids": shared + [8, 9]}], params, use_tqdm=False)[0]
    assert stats().prefix_cache_hits == 48
    assert stats().prefix_cache_queries == queries + 50
    assert out.num_cached_tokens == 48
    assert stats().kv_cache_usage == 0.0
    assert llm.llm_engine.reset_prefix_cache()
    again = llm.generate([{"prompt_token_ids": shared + [8, 9]}], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and stats().prefix_cache_hits == 48


def test_block_manager_refcounts_lru_and_token_check():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(9)))  # two full blocks + one token
    assert bm.allocate(a, 9, bm.match_prefix(a))
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a, a.num_computed_tokens)
    assert len(bm.cached_blocks) == 2

    b = _req("b", list(range(8)) + [99])
    hits = bm.match_prefix(b)
    assert hits == bm.block_table("a")[:2]
    assert bm.allocate(b, 1, hits)
    assert [bm.blocks[i].ref_cnt for i in hits] == [2, 2]

    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 6
    # Cached blocks survive in the free queue and are handed out last (LRU).
    c = _req("c", list(range(100, 112)))
    assert bm.allocate(c, 12, bm.match_prefix(c))
    assert not set(bm.block_table("c")) & set(hits)
    assert len(bm.cached_blocks) == 2
    # A block whose hash matches but whose tokens differ is not a hit.
    blk = bm.blocks[hits[0]]
    blk.token_ids = (0, 0, 0, 0)
    assert bm.match_prefix(_req("d", list(range(9)))) == []
    bm.free(c)
    # Allocating everything evicts the cached blocks.
    e = _req("e", list(range(200, 224)))
    assert bm.allocate(e, 24, [])
    assert bm.cached_blocks == {}
    assert not bm.allocate(_req("f", [1, 2]), 2, [])


def test_allocate_failure_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    r = _req("r", list(range(12)))
    assert not bm.allocate(r, 12, [])
    assert bm.block_table("r") == [] and bm.num_free_blocks == 2


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = _req("a", list(range(9)))
    assert bm.allocate(a, 9, bm.match_prefix(a))
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a, a.num_computed_tokens)
    bm.free(a)
    assert bm.match_prefix(_req("b", list(range(9)))) == []


@pytest.mark.parametrize("bad", [0, -3])
def test_block_manager_rejects_empty_pool(bad):
    with pytest.raises(ValueError):
        BlockManager(num_blocks=bad, block_size=4, enable_prefix_caching=True)
