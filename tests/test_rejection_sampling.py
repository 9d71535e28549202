"""Rejection sampling keeps the target's distribution whatever the drafts are: chi-square tests of the
verifier alone (known distributions, many rows at once) and of the engine (a tiny model sampled with and
without n-gram speculation), plus the greedy rule and the n-gram lookup."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from conftest import DEVICE, chi_square_p

from ember import LLM, SamplingParams
from ember.core.ngram import propose_ngram
from ember.sampling.rejection import DraftRows, verify

ALPHA = 1e-3  # a correct sampler fails one of these tests one time in a thousand per comparison


def _two_sample_p_value(a: Counter, b: Counter) -> float:
    """Chi-square test that two samples of categories come from one distribution (categories seen
    fewer than 10 times in both together are pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rest_a, rest_b = na - sum(a[k] for k in keys), nb - sum(b[k] for k in keys)
    cells = [(a[k], b[k]) for k in keys] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    stat = 0.0
    for x, y in cells:
        total = x + y
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.mark.parametrize("draft", [[3, 3], [0, 5], [6, 1]])
def test_verify_emits_the_target_distribution(draft):
    """Each of many identical requests drafts the same two tokens against fixed target distributions
    p0 (first position) and p1 (after the first draft): the first emitted token must follow p0, and
    where the first draft was accepted, the second must follow p1, whether drafts are likely or not."""
    torch.manual_seed(0)
    vocab, n = 8, 40_000
    p = torch.softmax(torch.randn(3, vocab) * 1.5, dim=-1)
    p[0, 6] = 0.0  # a draft the target never samples (a banned token): always rejected
    p = p / p.sum(dim=-1, keepdim=True)
    logits = p.log().repeat(n, 1)  # request i owns rows 3i .. 3i + 2
    rows = DraftRows.build([list(draft)] * n, torch.device("cpu"))
    out = verify(logits, torch.zeros(n, dtype=torch.bool), rows, {})
    first = out.token_ids[:, 0]
    assert chi_square_p(torch.bincount(first, minlength=vocab).tolist(), (p[0] * n).tolist()) > ALPHA
    accepted = first == draft[0]
    if p[0, draft[0]] == 0:  # never accepted: the first token came from the residual every time
        assert not bool(accepted.any())
        return
    second = out.token_ids[accepted, 1]
    expected = (p[1] * int(accepted.sum())).tolist()
    assert chi_square_p(torch.bincount(second, minlength=vocab).tolist(), expected) > ALPHA
    assert bool((out.num_tokens >= 1).all()) and bool((out.num_tokens <= 3).all())


def test_verify_greedy_keeps_the_agreeing_prefix():
    logits = torch.full((7, 5), -1.0)
    for row, best in enumerate([2, 4, 1, 0, 3, 3, 2]):
        logits[row, best] = 1.0
    # request 0 drafts [2, 4, 0] (rows 0-3: argmaxes 2, 4, 1, 0): two accepted, then the target's 1;
    # request 1 drafts [3, 3] (rows 4-6: argmaxes 3, 3, 2): both accepted, then the bonus 2
    rows = DraftRows.build([[2, 4, 0], [3, 3]], torch.device("cpu"))
    out = verify(logits, torch.ones(2, dtype=torch.bool), rows, {})
    assert out.num_tokens.tolist() == [3, 3]
    assert out.token_ids.tolist() == [[2, 4, 1, -1], [3, 3, 2, -1]]


def test_ngram_lookup():
    assert propose_ngram([1, 2, 3, 4, 9, 1, 2, 3], 3, 1, 3) == [4, 9, 1]
    assert propose_ngram([5, 6, 7], 2, 1, 3) == []  # nothing recurs
    assert propose_ngram([1, 2, 1, 2, 8, 1, 2], 2, 2, 2) == [8, 1]  # the latest earlier occurrence
    assert propose_ngram([7, 7], 4, 1, 2) == [7]  # as many as follow the match
    assert propose_ngram([1, 2, 3], 0, 1, 3) == []


def test_engine_sampling_distribution_is_unchanged(llama_dir):
    """Temperature 0.4 with top-k, continuing the model's own 60-token greedy continuation of a random
    prompt (a tiny random model falls into loops), so that n-gram drafts are the model's likely tokens:
    many are accepted, many rejected. The later tokens' distributions with speculation match plain
    sampling. Every request is seeded, so the test's outcome is fixed."""
    rng = random.Random(11)
    head = rng.sample(range(5, 500), 40)
    plain_llm = LLM(str(llama_dir), device=DEVICE, dtype="float32", kv_cache_memory=0.05)
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    continuation = plain_llm.generate([{"prompt_token_ids": head}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    prompt = {"prompt_token_ids": head + list(continuation)}
    params = [SamplingParams(temperature=0.4, top_k=20, max_tokens=4, ignore_eos=True, seed=i) for i in range(2000)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    spec["draft_token_budget"] = 4096  # drafts for all 256 running requests (the CPU default turns them off)
    samples = {}
    for name, config in (("plain", None), ("spec", spec)):
        llm = (
            plain_llm
            if config is None
            else LLM(str(llama_dir), device=DEVICE, dtype="float32", kv_cache_memory=0.05, speculative_config=config)
        )
        outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        samples[name] = [tuple(o.outputs[0].token_ids) for o in outs]
        if config is not None:
            drafted = sum(o.metrics.num_draft_tokens for o in outs)
            accepted = sum(o.metrics.num_accepted_tokens for o in outs)
            assert drafted > 500 and 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted)
    for position in (1, 2, 3):
        a = Counter(s[position] for s in samples["plain"])
        b = Counter(s[position] for s in samples["spec"])
        assert _two_sample_p_value(a, b) > ALPHA
    pairs = Counter(s[:2] for s in samples["plain"]), Counter(s[:2] for s in samples["spec"])
    assert _two_sample_p_value(*pairs) > ALPHA
