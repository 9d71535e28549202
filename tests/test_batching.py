"""Continuous batching must not change results: a prompt's greedy output is the same alone, inside
a batch of 32, with chunked prefill, and when KV pressure forces preemption and recomputation;
each also with async scheduling (step N+1 launched before step N's tokens reach the host), which
runs the same code path on the CPU as on a GPU."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEVICE

from ember import LLM, SamplingParams

NUM_PROMPTS = 32
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    rng = random.Random(1)
    lengths = [rng.randint(3, 200) for _ in range(NUM_PROMPTS)]
    return [{"prompt_token_ids": [rng.randint(5, 511) for _ in range(n)]} for n in lengths]


@pytest.fixture(scope="module")
def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(llama_dir, prompts, greedy) -> list[list[int]]:
    llm = LLM(str(llama_dir), kv_cache_memory=0.05, max_num_seqs=1, device=DEVICE, dtype="float32")
    return [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def _run(llama_dir, prompts, greedy, **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(llama_dir), device=DEVICE, dtype="float32", **engine_args)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batch_equals_alone(llama_dir, prompts, greedy, alone, async_scheduling):
    got, llm = _run(llama_dir, prompts, greedy, kv_cache_memory=0.05, async_scheduling=async_scheduling)
    assert got == alone
    assert all(len(t) == MAX_TOKENS for t in got)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_equals_alone(llama_dir, prompts, greedy, alone, async_scheduling):
    # A 40-token budget splits every long prompt over several steps, mixed with other decodes.
    got, llm = _run(
        llama_dir, prompts, greedy, kv_cache_memory=0.05, max_num_batched_tokens=40, async_scheduling=async_scheduling
    )
    assert got == alone


@pytest.mark.parametrize("prefix_caching,async_scheduling", [(False, False), (True, False), (True, True)])
def test_preemption_equals_alone(llama_dir, prompts, greedy, alone, prefix_caching, async_scheduling):
    # 40 blocks of 16 tokens hold ~3 sequences at once: the scheduler must preempt and recompute.
    bm_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, block, kv heads, head_dim, fp32
    got, llm = _run(
        llama_dir,
        prompts,
        greedy,
        kv_cache_memory=40 * bm_bytes / 2**30,
        block_size=16,
        max_model_len=256,
        enable_prefix_caching=prefix_caching,
        async_scheduling=async_scheduling,
    )
    engine = llm.llm_engine
    assert engine.ready.num_blocks == 40
    stats = engine.scheduler_stats()
    assert stats.num_preemptions > 0
    assert got == alone
    assert stats.kv_cache_usage == 0.0


def test_kernel_warm_up_batches_run_through_the_runner(llama_dir):
    """The start-up warm-up (CUDA only) feeds these batches to the runner: every prefill tile height next
    to a decode, over cached context, and the row counts between the decode graphs and the full batch.
    Here they run on the CPU path: each samples one token per row."""
    from conftest import inproc_core

    from ember.runner.warmup import warm_up_batches

    llm = LLM(str(llama_dir), device=DEVICE, dtype="float32", kv_cache_memory=0.05, engine_process=False)
    runner = inproc_core(llm).runner
    batches = warm_up_batches(16, runner.kv_cache.num_blocks, 256, 2048, 512)
    # then fresh prefills of 2^k + 1 tokens in all from 256 on below the step's budget, cut at max_model_len
    assert [b.num_new_tokens for b in batches] == [[1, n] for n in (2, 3, 5, 9, 17, 33, 65, 129)] + [
        [257],
        [512, 1],
        [512, 512, 1],
    ]
    alone = warm_up_batches(16, runner.kv_cache.num_blocks, 1, 40, 512)  # one sequence a step, 40 tokens a step
    assert [b.num_new_tokens for b in alone] == [[2], [3], [5], [9], [17], [33]]
    for batch in batches + alone:
        result = runner.wait(runner.launch(batch))
        assert len(result.token_ids) == len(batch) and all(len(t) == 1 and 0 <= t[0] < 512 for t in result.token_ids)
    assert warm_up_batches(16, 3, 256, 2048, 512) == []  # a pool too small for the first batch: no warm-up
    # max_model_len 64: a block table has 4 blocks, so no warm-up request is longer (on a GPU the 81-token
    # chunk after a block of context once failed every engine of max_model_len 64 at start-up)
    short = warm_up_batches(16, runner.kv_cache.num_blocks, 256, 2048, 64)
    assert [b.num_new_tokens for b in short][:7] == [[1, n] for n in (2, 3, 5, 9, 17, 33)] + [[64] * 4 + [1]]
    assert all(len(r.prompt_token_ids) <= 64 for b in short for r in b.new_requests)


def test_sampling_tensors_are_reused_only_for_the_same_rows_without_per_step_state(llama_dir):
    """White-box: a decode step of the same requests in the same order reuses the last step's sampling
    tensors (in a fresh batch, so a step's grammar bitmask never carries over); other rows, another
    order, or a row whose min_tokens still holds EOS back get tensors built for that step."""
    from conftest import inproc_core

    from ember.runner.request_state import RequestState

    runner = inproc_core(
        LLM(str(llama_dir), device=DEVICE, dtype="float32", kv_cache_memory=0.05, engine_process=False)
    ).runner

    def request(name: str, **params) -> RequestState:
        return RequestState(name, [1, 2, 3], SamplingParams(max_tokens=8, **params), [7])

    a, b = request("a", temperature=0.5), request("b", temperature=0.9, top_p=0.8)
    first = runner._sampling_batch([a, b])
    first.token_bitmask = torch.zeros(2, 1, dtype=torch.int32)
    again = runner._sampling_batch([a, b])
    assert again is not first and again.token_bitmask is None and again.temperature is first.temperature
    swapped = runner._sampling_batch([b, a])
    assert swapped.temperature.tolist() == pytest.approx([0.9, 0.5])
    assert swapped.top_p.tolist() == pytest.approx([0.8, 1.0])

    held = request("held", temperature=0.0, min_tokens=2)
    assert runner._sampling_batch([a, held]).min_tokens_mask is not None
    held.output_token_ids.append(5)
    assert runner._sampling_batch([a, held]).min_tokens_mask is not None  # still one token short: rebuilt
    held.output_token_ids.append(5)
    released = runner._sampling_batch([a, held])
    assert released.min_tokens_mask is None
    assert runner._sampling_batch([a, held]).temperature is released.temperature


def test_static_bans_and_bias_are_reused_but_multi_token_bad_words_are_rebuilt(llama_dir):
    """White-box: logit_bias, allowed_token_ids and one-token bad words never change during a request, so
    the same rows' next step reuses their tensors; a bad word of several tokens bans by what the output
    ends with, so its rows get tensors built for each step."""
    from conftest import inproc_core

    from ember.runner.request_state import RequestState

    runner = inproc_core(
        LLM(str(llama_dir), device=DEVICE, dtype="float32", kv_cache_memory=0.05, engine_process=False)
    ).runner

    def request(name: str, **params) -> RequestState:
        return RequestState(name, [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, **params), [7])

    static = request("static", logit_bias={5: 3.0}, allowed_token_ids=[5, 6, 9], bad_words_token_ids=[[6]])
    first = runner._sampling_batch([static])
    again = runner._sampling_batch([static])
    assert again is not first and again.logit_bias is first.logit_bias
    assert again.allowed_token_ids is first.allowed_token_ids and again.bad_words_mask is first.bad_words_mask

    multi = request("multi", bad_words_token_ids=[[4, 5]])
    assert runner._sampling_batch([static, multi]).bad_words_mask[0].tolist() == [0]  # only static's token 6
    multi.output_token_ids.append(4)
    rows, ids = runner._sampling_batch([static, multi]).bad_words_mask
    assert list(zip(rows.tolist(), ids.tolist())) == [(0, 6), (1, 5)]
    multi.output_token_ids.append(1)
    assert runner._sampling_batch([static, multi]).bad_words_mask[0].tolist() == [0]
