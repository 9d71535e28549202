"""Speculative decoding is exact: under greedy decoding every method (n-gram lookup, a draft model) gives
the tokens of plain decoding, token for token in float32, also with chunked prefill, prefix caching,
preemption, logprobs, penalties, stop tokens and structured output; drafts are counted and budgeted,
rejected drafts' blocks go back, and bad configurations are refused with the field named."""

from __future__ import annotations

import random

import pytest
from conftest import DEVICE, inproc_core, make_checkpoint

from ember import LLM, SamplingParams
from ember.config import EngineArgs
from ember.sampling.structured import StructuredOutputsParams

# drafts for every running request (the CPU's default budget turns them off beyond a couple of requests)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "draft_token_budget": 1024,
}
ENGINE = dict(device=DEVICE, dtype="float32", kv_cache_memory=0.05)


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    """Random prompts, half of them repeating a phrase, so that n-gram drafts are both accepted and rejected."""
    rng = random.Random(3)
    out = []
    for i in range(12):
        phrase = [rng.randint(5, 511) for _ in range(rng.randint(3, 12))]
        tail = [rng.randint(5, 511) for _ in range(rng.randint(1, 40))]
        out.append({"prompt_token_ids": (phrase * 4 + tail) if i % 2 else tail + phrase})
    return out


@pytest.fixture(scope="module")
def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def plain(llama_dir, prompts, greedy):
    return LLM(str(llama_dir), **ENGINE).generate(prompts, greedy, use_tqdm=False)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """A different model of the same vocabulary: its drafts are often wrong."""
    return str(make_checkpoint(tmp_path_factory.mktemp("draft") / "llama", "llama", num_hidden_layers=1))


def _assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert lg.keys() == lw.keys()
            for t in lg:
                assert lg[t].logprob == pytest.approx(lw[t].logprob, abs=1e-4)


def _spec_config(kind: str, llama_dir, other_draft) -> dict:
    if kind == "ngram":
        return NGRAM
    model = str(llama_dir) if kind == "draft-same" else other_draft
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 4, "draft_token_budget": 1024}


@pytest.mark.parametrize("kind", ["ngram", "draft-same", "draft-other"])
def test_greedy_is_exact(llama_dir, other_draft, prompts, greedy, plain, kind):
    llm = LLM(str(llama_dir), **ENGINE, speculative_config=_spec_config(kind, llama_dir, other_draft))
    got = llm.generate(prompts, greedy, use_tqdm=False)
    _assert_same(got, plain)
    drafted = sum(o.metrics.num_draft_tokens for o in got)
    accepted = sum(o.metrics.num_accepted_tokens for o in got)
    assert drafted > 0 and accepted > 0
    if kind == "draft-same":  # the target as its own draft model: every draft is the target's choice
        assert accepted == drafted
    else:
        assert accepted < drafted
    spec = llm.llm_engine.scheduler_stats().spec_decode
    assert spec is not None and spec.num_draft_tokens == drafted and spec.num_accepted_tokens == accepted
    assert sum(spec.num_accepted_tokens_per_pos) == accepted
    assert spec.num_accepted_tokens_per_pos == sorted(spec.num_accepted_tokens_per_pos, reverse=True)


@pytest.mark.parametrize("kind", ["ngram", "draft-other"])
def test_exact_with_chunked_prefill_preemption_and_prefix_cache(llama_dir, other_draft, prompts, greedy, plain, kind):
    """24 blocks of 16 tokens hold ~3 sequences: requests are preempted and recomputed, and prompts are
    cut into 24-token chunks; a second round finds its prompts in the prefix cache. Every block is free
    at the end."""
    bm_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, block, kv heads, head_dim, fp32
    if kind != "ngram":
        bm_bytes += 2 * 1 * 16 * 2 * 16 * 4  # the one-layer draft model's KV for the same blocks
    llm = LLM(
        str(llama_dir),
        device=DEVICE,
        dtype="float32",
        kv_cache_memory=24 * bm_bytes / 2**30,
        max_model_len=256,
        max_num_batched_tokens=24,
        speculative_config=_spec_config(kind, llama_dir, other_draft),
    )
    assert llm.llm_engine.ready.num_blocks == 24
    _assert_same(llm.generate(prompts, greedy, use_tqdm=False), plain)
    assert llm.llm_engine.scheduler_stats().num_preemptions > 0
    _assert_same(llm.generate(prompts[:3], greedy, use_tqdm=False), plain[:3])
    stats = llm.llm_engine.scheduler_stats()
    assert stats.prefix_cache_hits > 0 and stats.kv_cache_usage == 0.0
    assert stats.spec_decode is not None and stats.spec_decode.num_draft_tokens > 0


def test_penalties_stop_tokens_and_min_tokens(llama_dir, prompts):
    """Rows after drafts count the drafts as output: penalties, min_tokens and stops see the same
    history as in plain decoding."""
    params = [
        SamplingParams(temperature=0, max_tokens=30, presence_penalty=0.7, frequency_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, min_tokens=10),
    ]
    reference = LLM(str(llama_dir), **ENGINE)
    plain = reference.generate(prompts, params * 6, use_tqdm=False)
    # the token plain greedy decoding emits at position 12 becomes a stop token: the output ends there
    free = reference.generate(prompts[1:2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stop = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[free[0].outputs[0].token_ids[12]]
    )
    plain_stop = reference.generate(prompts[1:2], stop, use_tqdm=False)
    llm = LLM(str(llama_dir), **ENGINE, speculative_config=NGRAM)
    got = llm.generate(prompts, params * 6, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    got_stop = llm.generate(prompts[1:2], stop, use_tqdm=False)[0].outputs[0]
    assert got_stop.token_ids == plain_stop[0].outputs[0].token_ids
    assert got_stop.finish_reason == "stop" and len(got_stop.token_ids) <= 13


def test_structured_output_under_speculation(llama_dir, prompts):
    params = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"(ab|cd){2,8}e")
    )
    want = LLM(str(llama_dir), **ENGINE).generate(prompts[:4], params, use_tqdm=False)
    got = LLM(str(llama_dir), **ENGINE, speculative_config=NGRAM).generate(prompts[:4], params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]


def test_draft_budget_turns_speculation_down(llama_dir):
    """`draft_token_budget` drafts a step at most: 3 per request alone, none for 9 running requests."""
    config = {**NGRAM, "draft_token_budget": 8}
    llm = LLM(str(llama_dir), **ENGINE, speculative_config=config, engine_process=False)
    scheduler = inproc_core(llm).scheduler
    assert scheduler.num_draft_tokens() == 3
    repeat = {"prompt_token_ids": [7, 8, 9] * 10}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate([repeat] * 9, params, use_tqdm=False)
    assert sum(o.metrics.num_draft_tokens for o in out) == 0
    for running, drafts in ((2, 3), (4, 2), (8, 1), (9, 0)):  # how the rule scales
        scheduler.running = [None] * running  # type: ignore[list-item]
        assert scheduler.num_draft_tokens() == drafts
    scheduler.running = []


def test_rejected_drafts_give_their_blocks_back(llama_dir):
    """Block size 2 and 3 drafts: a rejected draft's slots often fill a block of their own, which is
    released at once (the request's table shrinks) and nothing leaks by the end."""
    llm = LLM(str(llama_dir), **ENGINE, block_size=2, speculative_config=NGRAM, engine_process=False)
    core = inproc_core(llm)
    trims = []
    original = core.block_manager.trim

    def counting(request, num_tokens):
        kept = original(request, num_tokens)
        trims.append(kept)
        return kept

    core.block_manager.trim = counting
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randint(5, 511) for _ in range(30)]} for _ in range(6)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert any(k is not None for k in trims)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


@pytest.mark.parametrize(
    "config,field",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tokens": 3}, "draft_tokens"),
        ('{"method": "ngram", ', "JSON"),
    ],
)
def test_bad_configs_name_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(speculative_config=config)


def test_draft_model_vocabulary_must_match(llama_dir, tmp_path):
    other = make_checkpoint(tmp_path / "small-vocab", "llama", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(
            str(llama_dir),
            **ENGINE,
            speculative_config={"method": "draft_model", "model": str(other), "num_speculative_tokens": 2},
        )
