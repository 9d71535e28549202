import math

import numpy as np
import pytest
import torch

from ember.sampling.params import SamplingParams
from ember.sampling.sampler import (
    Sampler,
    SamplingBatch,
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
)

CPU = torch.device("cpu")
EOS = 2


def make_batch(
    params: list[SamplingParams],
    vocab_size: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingBatch:
    n = len(params)
    if generators is None:
        generators = [_gen(p.seed) if p.seed is not None else None for p in params]
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    return SamplingBatch.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs,
        [len(o) for o in outputs],
        generators,
        [[EOS]] * n,
        vocab_size,
        CPU,
    )


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator(device=CPU)
    g.manual_seed(seed)
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> torch.Tensor:
    batch = make_batch(params, logits.shape[1], **kwargs)
    return Sampler()(logits.clone(), batch).sampled_token_ids


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=_gen(seed)) * 2


# --- SamplingParams -------------------------------------------------------------


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("n", {"n": 0}),
        ("n", {"n": True}),
        ("n", {"n": 1.5}),
        ("temperature", {"temperature": -1}),
        ("temperature", {"temperature": math.inf}),
        ("temperature", {"temperature": math.nan}),
        ("temperature", {"temperature": "1"}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.01}),
        ("top_k", {"top_k": -2}),
        ("top_k", {"top_k": 2.0}),
        ("min_p", {"min_p": -0.1}),
        ("min_p", {"min_p": 1.5}),
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("frequency_penalty", {"frequency_penalty": -2.1}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": "16"}),
        ("min_tokens", {"min_tokens": -1}),
        ("min_tokens", {"min_tokens": 17, "max_tokens": 16}),
        ("seed", {"seed": 1.0}),
        ("seed", {"seed": False}),
        ("stop", {"stop": [""]}),
        ("stop", {"stop": ["ok", 3]}),
        ("stop", {"stop": 3}),
        ("stop_token_ids", {"stop_token_ids": [-1]}),
        ("stop_token_ids", {"stop_token_ids": [True]}),
        ("stop_token_ids", {"stop_token_ids": 5}),
        ("logprobs", {"logprobs": 21}),
        ("logprobs", {"logprobs": -1}),
        ("prompt_logprobs", {"prompt_logprobs": 21}),
        ("prompt_logprobs", {"prompt_logprobs": "3"}),
        ("ignore_eos", {"ignore_eos": 1}),
        ("skip_special_tokens", {"skip_special_tokens": None}),
        ("logit_bias", {"logit_bias": {5: 100.5}}),
        ("logit_bias", {"logit_bias": {5: -101}}),
        ("logit_bias", {"logit_bias": {5: math.nan}}),
        ("logit_bias", {"logit_bias": {5: "1"}}),
        ("logit_bias", {"logit_bias": {"5": 1.0}}),
        ("logit_bias", {"logit_bias": {-1: 1.0}}),
        ("logit_bias", {"logit_bias": {True: 1.0}}),
        ("logit_bias", {"logit_bias": [5]}),
        ("allowed_token_ids", {"allowed_token_ids": []}),
        ("allowed_token_ids", {"allowed_token_ids": [3, -1]}),
        ("allowed_token_ids", {"allowed_token_ids": [1.0]}),
        ("allowed_token_ids", {"allowed_token_ids": 5}),
        ("bad_words", {"bad_words": "word"}),
        ("bad_words", {"bad_words": ["ok", ""]}),
        ("bad_words", {"bad_words": ["  "]}),
        ("bad_words", {"bad_words": [3]}),
        ("bad_words_token_ids", {"bad_words_token_ids": [[]]}),
        ("bad_words_token_ids", {"bad_words_token_ids": [[3, -1]]}),
        ("bad_words_token_ids", {"bad_words_token_ids": [3]}),
    ],
)
def test_invalid_params_name_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_params_normalisation() -> None:
    p = SamplingParams(stop="###", top_k=-1, temperature=0, max_tokens=None, min_tokens=5)
    assert p.stop == ["###"]
    assert p.top_k == 0
    assert isinstance(p.temperature, float)
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []
    assert SamplingParams(stop_token_ids=(7, 8)).stop_token_ids == [7, 8]


def test_sampling_field_normalisation() -> None:
    p = SamplingParams(logit_bias={np.int64(5): 100, 7: np.float32(-2.5)}, allowed_token_ids=(3, 4), bad_words=("a",))
    assert p.logit_bias == {5: 100.0, 7: -2.5} and all(type(k) is int for k in p.logit_bias)
    assert all(type(v) is float for v in p.logit_bias.values())
    assert p.allowed_token_ids == [3, 4] and p.bad_words == ["a"]
    empty = SamplingParams(logit_bias={}, bad_words=[], bad_words_token_ids=[])
    assert empty.logit_bias is None and empty.bad_words is None and empty.bad_words_token_ids is None


def test_sampling_fields_round_trip_through_the_core_message() -> None:
    """The core gets SamplingParams as msgpack: the new fields (int keys of logit_bias included) survive."""
    import msgspec

    from ember.messages import EngineCoreRequest

    params = SamplingParams(
        logit_bias={5: 100.0, 9: -3.25}, allowed_token_ids=[1, 5, 9], bad_words_token_ids=[[4], [6, 7]], min_tokens=2
    )
    msg = EngineCoreRequest("r", [1, 2], params, 8, [2], 0.0)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=EngineCoreRequest)
    assert back.sampling_params == params and back.sampling_params.logit_bias == {5: 100.0, 9: -3.25}


def test_is_greedy_and_clone() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(seed=1).is_greedy
    p = SamplingParams(stop=["a"], stop_token_ids=[1])
    q = p.clone()
    q.stop.append("b")
    q.stop_token_ids.append(2)
    assert p == SamplingParams(stop=["a"], stop_token_ids=[1])


# --- greedy and seeding ---------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = random_logits(8, 50)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_mixed_batch_keeps_greedy_rows_exact() -> None:
    logits = random_logits(8, 50)
    params = [
        SamplingParams(temperature=0.0, top_k=3)
        if i % 2 == 0
        else SamplingParams(temperature=1.5, top_k=10, top_p=0.9, min_p=0.01, seed=i)
        for i in range(8)
    ]
    for _ in range(5):
        out = sample(logits, params)
        assert torch.equal(out[::2], logits[::2].argmax(dim=-1))


def test_same_seed_same_tokens_across_calls() -> None:
    logits = torch.zeros(16, 1000)  # flat: the token is decided by the noise alone
    params = [SamplingParams(seed=100 + i) for i in range(16)]
    first = sample(logits, params)
    assert torch.equal(sample(logits, params), first)
    assert len(set(first.tolist())) > 8  # seeds actually matter
    # A generator kept across steps yields the same stream every time.
    streams = []
    for _ in range(2):
        gens = [_gen(p.seed) for p in params]
        streams.append(torch.stack([sample(logits, params, generators=gens) for _ in range(4)]))
    assert torch.equal(streams[0], streams[1])
    assert not torch.equal(streams[0][0], streams[0][1])


def test_seeded_row_independent_of_batch_mates() -> None:
    vocab = 200
    target = random_logits(1, vocab, seed=1)[0] * 0.3
    target_params = SamplingParams(seed=1234, temperature=0.9, top_p=0.95)
    alone = sample(target.unsqueeze(0), [target_params])[0]

    for size, position in [(2, 0), (5, 3), (9, 8)]:
        for mates_seeded in (False, True):
            with torch.random.fork_rng():
                torch.manual_seed(size * 10 + position)
                logits = random_logits(size, vocab, seed=size)
                logits[position] = target
                params = [
                    SamplingParams(seed=i if mates_seeded else None, top_k=5 + i, temperature=0.5)
                    if i % 3
                    else SamplingParams(temperature=0.0)
                    for i in range(size)
                ]
                params[position] = target_params
                assert sample(logits, params)[position] == alone


# --- filtering and distributions ------------------------------------------------

# Probabilities in descending order; shuffled into token ids so position != rank.
PROBS = torch.tensor([0.30, 0.22, 0.16, 0.12, 0.08, 0.05, 0.04, 0.02, 0.007, 0.003], dtype=torch.float64)
TOKEN_ORDER = torch.tensor([7, 2, 9, 0, 4, 1, 8, 3, 6, 5])
DRAWS = 5000


def _reference_logits() -> torch.Tensor:
    logits = torch.empty(10, dtype=torch.float64)
    logits[TOKEN_ORDER] = PROBS.log()
    return logits


def _empirical(params: SamplingParams) -> torch.Tensor:
    logits = _reference_logits().float().expand(DRAWS, -1).clone()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = sample(logits, [params] * DRAWS)
    return torch.bincount(out, minlength=10).double() / DRAWS


def _expected(allowed: list[int], temperature: float) -> torch.Tensor:
    logits = _reference_logits() / temperature
    mask = torch.full((10,), -math.inf, dtype=torch.float64)
    mask[allowed] = 0.0
    return torch.softmax(logits + mask, dim=-1)


@pytest.mark.parametrize(
    "params, allowed_ranks",
    [
        (SamplingParams(temperature=1.0), list(range(10))),
        (SamplingParams(temperature=0.7), list(range(10))),
        (SamplingParams(top_k=3), [0, 1, 2]),
        (SamplingParams(top_k=4, temperature=1.3), [0, 1, 2, 3]),
        # cumulative 0.30, 0.52, 0.68 >= 0.6 -> three tokens
        (SamplingParams(top_p=0.6), [0, 1, 2]),
        # with T=2 probs flatten; computed below against the tempered distribution
        (SamplingParams(top_p=0.5, temperature=2.0), None),
        # threshold 0.3 * 0.30 = 0.09 keeps 0.30, 0.22, 0.16, 0.12
        (SamplingParams(min_p=0.3), [0, 1, 2, 3]),
        (SamplingParams(min_p=0.3, top_k=2), [0, 1]),
    ],
)
def test_filtered_sampling_distribution(params: SamplingParams, allowed_ranks: list[int] | None) -> None:
    if allowed_ranks is None:
        tempered = torch.softmax(PROBS.log() / params.temperature, dim=0)
        above = torch.cumsum(tempered, 0) - tempered
        allowed_ranks = [r for r in range(10) if above[r] < params.top_p]
        assert 1 < len(allowed_ranks) < 10
    allowed = TOKEN_ORDER[allowed_ranks].tolist()
    freq = _empirical(params)
    disallowed = [t for t in range(10) if t not in allowed]
    assert freq[disallowed].sum() == 0
    expected = _expected(allowed, params.temperature)
    assert (freq - expected).abs().max() < 0.03


def test_filters_skipped_when_unused() -> None:
    batch = make_batch([SamplingParams(), SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)], 10)
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None
    assert batch.temperature is None and batch.penalties is None and batch.max_num_logprobs is None


# --- penalties and min_tokens ---------------------------------------------------


def _reference_penalties(
    logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    ref = logits.double().clone()
    for row, p in enumerate(params):
        for token in set(prompts[row]) | set(outputs[row]):
            x = ref[row, token]
            ref[row, token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for token in set(outputs[row]):
            count = outputs[row].count(token)
            ref[row, token] -= p.frequency_penalty * count + p.presence_penalty
    return ref


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_match_reference(seed: int) -> None:
    gen = _gen(seed)
    rows, vocab = 5, 12
    logits = torch.randn(rows, vocab, generator=gen) * 3
    prompts = [
        torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in torch.randint(0, 8, (rows,), generator=gen)
    ]
    outputs = [
        torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in torch.randint(0, 10, (rows,), generator=gen)
    ]
    outputs[0] = []  # a row with no output yet
    params = [
        SamplingParams(
            repetition_penalty=float(torch.empty(1).uniform_(0.5, 2.0, generator=gen)),
            frequency_penalty=float(torch.empty(1).uniform_(-2, 2, generator=gen)),
            presence_penalty=float(torch.empty(1).uniform_(-2, 2, generator=gen)),
        )
        for _ in range(rows)
    ]
    params[1] = SamplingParams()  # default row in a penalised batch is untouched
    batch = make_batch(params, vocab, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits.clone(), batch)
    expected = _reference_penalties(logits, params, prompts, outputs)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got[1], logits[1])


def test_frequency_penalty_only_ignores_prompt() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.5)]
    assert sample(logits, params, prompts=[[0, 0, 0]], outputs=[[]]).item() == 0
    assert sample(logits, params, prompts=[[]], outputs=[[0]]).item() == 1
    assert make_batch(params, 4).penalties.prompt_token_ids is None


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    vocab = 8
    logits = torch.zeros(3, vocab)
    logits[:, EOS] = 5.0
    logits[:, 6] = 4.0
    logits[:, 3] = 3.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6]),
    ]
    outputs = [[1, 1], [1, 1], [1, 1, 1]]
    masked = apply_min_tokens(logits.clone(), make_batch(params, vocab, outputs=outputs))
    assert masked[0, EOS] == -math.inf and masked[0, 6] == -math.inf
    assert masked[1, EOS] == 5.0 and masked[1, 6] == -math.inf
    assert torch.equal(masked[2], logits[2])
    assert sample(logits, params, outputs=outputs).tolist() == [3, EOS, EOS]


# --- allowed_token_ids, bad words, logit_bias -----------------------------------


def _reference_bans_and_bias(
    logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]
) -> torch.Tensor:
    """Row by row in plain torch, in vLLM's order: allowed tokens, bad words, min_tokens, logit_bias."""
    ref = logits.clone()
    for row, (p, out) in enumerate(zip(params, outputs)):
        if p.allowed_token_ids is not None:
            keep = torch.zeros(logits.shape[1], dtype=torch.bool)
            keep[p.allowed_token_ids] = True
            ref[row, ~keep] = -math.inf
        for seq in p.bad_words_token_ids or []:
            *prefix, last = seq
            if len(out) >= len(prefix) and (not prefix or out[-len(prefix) :] == prefix):
                ref[row, last] = -math.inf
        if len(out) < p.min_tokens:
            ref[row, [EOS, *p.stop_token_ids]] = -math.inf
        for token, bias in (p.logit_bias or {}).items():
            ref[row, token] += torch.tensor(bias, dtype=torch.float32)
    return ref


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bans_and_bias_match_a_row_by_row_reference(seed: int) -> None:
    gen = _gen(seed)
    rows, vocab = 7, 40
    logits = torch.randn(rows, vocab, generator=gen) * 3

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    outputs = [ids(int(n)) for n in torch.randint(0, 6, (rows,), generator=gen)]
    outputs[3] = []
    params = [
        SamplingParams(
            temperature=0.0, logit_bias={t: float(b) for t, b in zip(ids(5), torch.randn(5, generator=gen) * 30)}
        ),
        SamplingParams(temperature=0.0, allowed_token_ids=ids(4)),
        SamplingParams(temperature=0.0, bad_words_token_ids=[ids(1), ids(1), outputs[2][-1:] + ids(1), ids(3)]),
        SamplingParams(temperature=0.0, min_tokens=2, logit_bias={EOS: 100.0, 1: -100.0}, bad_words_token_ids=[[4, 5]]),
        SamplingParams(temperature=0.0),
        SamplingParams(
            temperature=0.0,
            allowed_token_ids=ids(6),
            logit_bias={t: 50.0 for t in ids(3)},
            bad_words_token_ids=[outputs[5][-2:] + ids(1), ids(1)],
            min_tokens=10,
            stop_token_ids=ids(2),
        ),
        SamplingParams(temperature=0.0, logit_bias={7: -100.0, 8: 100.0, 9: 0.5}),
    ]
    batch = make_batch(params, vocab, outputs=outputs)
    got = Sampler().score(logits.clone(), batch).values  # all greedy: the logits as sampling sees them
    expected = _reference_bans_and_bias(logits, params, outputs)
    assert torch.equal(got, expected)  # the same float32 additions, exactly
    assert torch.equal(got[4], logits[4])
    assert torch.equal(Sampler()(logits.clone(), batch).sampled_token_ids, expected.argmax(dim=-1))


def test_multi_token_bad_word_bans_its_last_token_only_after_the_rest() -> None:
    """vLLM's rule: a bad word's last token is banned when the output so far ends with all its other
    tokens; a partial match (its middle only, or its start further back) bans nothing."""
    vocab = 12
    word = [3, 4, 5]
    params = [SamplingParams(temperature=0.0, bad_words_token_ids=[word, [9], [7, 7]])]
    cases = [
        ([], {9}),  # a one-token bad word is banned from the first token on
        ([3], {9}),
        ([4], {9}),  # the end of the prefix alone
        ([1, 3, 4], {5, 9}),
        ([3, 4], {5, 9}),
        ([3, 4, 1], {9}),
        ([3, 3, 4, 4], {9}),
        ([7], {7, 9}),  # a word repeating one token bans it right after the first
        (
            [3, 4, 7],
            {
                7,
                9,
            },
        ),
    ]
    for out, banned in cases:
        batch = make_batch(params, vocab, outputs=[out])
        assert batch.bad_words_per_step and not batch.reusable
        masked = apply_bad_words(torch.zeros(1, vocab), batch)
        assert set(torch.nonzero(masked[0].isinf()).flatten().tolist()) == banned, out


def test_allowed_token_ids_mask_and_sampling() -> None:
    """Random rows sample only allowed tokens; a row without the field is untouched; ids past the
    vocabulary (the core refuses them first) allow nothing."""
    vocab = 50
    logits = random_logits(3, vocab, seed=5)
    params = [
        SamplingParams(allowed_token_ids=[3, 17, 17, 42], seed=1),
        SamplingParams(seed=2),
        SamplingParams(temperature=0.0, allowed_token_ids=[5, 60]),
    ]
    batch = make_batch(params, vocab)
    masked = apply_allowed_token_ids(logits.clone(), batch)
    assert torch.nonzero(~masked[0].isinf()).flatten().tolist() == [3, 17, 42]
    assert torch.equal(masked[0, [3, 17, 42]], logits[0, [3, 17, 42]])
    assert torch.equal(masked[1], logits[1])
    assert torch.nonzero(~masked[2].isinf()).flatten().tolist() == [5]
    many = [SamplingParams(allowed_token_ids=[3, 17, 42], temperature=2.0, top_p=0.99)] * 200
    drawn = sample(random_logits(200, vocab, seed=6), many)
    assert set(drawn.tolist()) == {3, 17, 42}


def test_logit_bias_is_added_and_keeps_raw_logprobs() -> None:
    vocab = 30
    logits = random_logits(2, vocab, seed=8)
    params = [SamplingParams(temperature=0.0, logprobs=2, logit_bias={4: 100.0, 5: -0.75}), SamplingParams(logprobs=1)]
    batch = make_batch(params, vocab)
    biased = apply_logit_bias(logits.clone(), batch)
    expected = logits.clone()
    expected[0, 4] += 100.0
    expected[0, 5] -= 0.75
    assert torch.equal(biased, expected)
    out = Sampler()(logits.clone(), batch)
    assert out.sampled_token_ids[0] == 4
    # vLLM reports the model's own distribution: logprobs before any bias or ban.
    torch.testing.assert_close(out.logprobs[0, 0], torch.log_softmax(logits, dim=-1)[0, 4])


def test_bans_and_bias_keep_the_argmax_shortcut_honest() -> None:
    """`argmax_only` (the runner then skips the logits) holds only when no row changes them; static bans
    and bias may be reused by the next step of the same rows, bans that look at the output may not."""
    vocab = 20
    greedy = SamplingParams(temperature=0.0)
    assert make_batch([greedy], vocab).argmax_only
    for changed in (
        SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[3]),
        SamplingParams(temperature=0.0, bad_words_token_ids=[[3]]),
    ):
        batch = make_batch([greedy, changed], vocab)
        assert not batch.argmax_only and batch.reusable and batch.mask_can_wait
    multi = make_batch([greedy, SamplingParams(temperature=0.0, bad_words_token_ids=[[3, 4]])], vocab)
    assert multi.bad_words_mask is None and multi.argmax_only  # nothing banned yet
    assert not multi.reusable  # but the next token may complete the prefix
    with pytest.raises(ValueError, match="host"):  # its output must be on the host (no tokens in flight)
        SamplingBatch.build(
            [SamplingParams(bad_words_token_ids=[[3, 4]])], [[]], [[3]], [2], [None], [[EOS]], vocab, CPU
        )


def test_multi_token_bad_words_make_a_request_wait_for_host_tokens() -> None:
    from ember.core.request import Request

    def needs(**kwargs) -> bool:
        return Request("r", [1], SamplingParams(**kwargs), 8, [EOS], 0.0).needs_host_tokens

    assert needs(bad_words_token_ids=[[3], [4, 5]]) and needs(repetition_penalty=1.2)
    assert not needs(bad_words_token_ids=[[3], [4]])
    assert not needs(logit_bias={3: 5.0}, allowed_token_ids=[3, 4], min_tokens=3)


# --- logprobs -------------------------------------------------------------------


def test_logprobs_are_raw_and_sorted() -> None:
    vocab = 30
    logits = random_logits(5, vocab, seed=3)
    params = [
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0, temperature=0.0, repetition_penalty=1.8),
        SamplingParams(logprobs=3, temperature=0.5, seed=7),
        SamplingParams(logprobs=5, top_k=2, frequency_penalty=1.0),
        SamplingParams(logprobs=5, temperature=0.0),
    ]
    outputs = [[], [int(logits[1].argmax())], [], [0, 0, 1], []]
    batch = make_batch(params, vocab, outputs=outputs)
    out = Sampler()(logits.clone(), batch)
    assert out.logprob_token_ids.shape == (5, 6) and out.logprobs.shape == (5, 6)
    assert out.logprob_token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    # The repetition penalty moved row 1 off its raw argmax; logprobs still describe raw logits.
    assert out.sampled_token_ids[1] != logits[1].argmax()
    reference = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.logprob_token_ids))
    top = out.logprobs[:, 1:]
    assert torch.all(top[:, :-1] >= top[:, 1:])
    assert torch.equal(out.logprob_token_ids[:, 1], logits.argmax(dim=-1))


def test_no_logprobs_requested() -> None:
    out = Sampler()(random_logits(2, 10), make_batch([SamplingParams()] * 2, 10))
    assert out.logprobs is None and out.logprob_token_ids is None
    assert out.sampled_token_ids.shape == (2,) and out.sampled_token_ids.dtype == torch.int64


@pytest.mark.parametrize("case", ["k", "p", "kp", "mixed", "flat"])
def test_candidate_top_k_top_p_keeps_the_same_tokens_as_a_full_sort(case, monkeypatch):
    from ember.sampling import sampler

    gen = torch.Generator().manual_seed(11)
    rows, vocab = 6, 5000
    logits = torch.randn(rows, vocab, generator=gen) * (0.5 if case == "flat" else 4.0)
    top_k = torch.tensor([5, 50, vocab, 700, 1, vocab]) if "k" in case or case == "mixed" else None
    top_p = torch.tensor([0.9, 0.5, 0.95, 1.0, 0.7, 0.8]) if "p" in case or case in ("mixed", "flat") else None
    monkeypatch.setattr(sampler, "TOP_CANDIDATES", 256)
    fast = sampler._top_k_top_p_candidates(logits.clone(), top_k, top_p)
    full = sampler.apply_top_k_top_p_sorted(logits.clone(), top_k, top_p)
    if case == "flat":
        assert fast is None  # flat distributions: the nucleus needs more than 256 candidates
        assert torch.equal(sampler.apply_top_k_top_p(logits.clone(), top_k, top_p).isinf(), full.isinf())
        return
    assert fast is not None
    assert torch.equal(fast.isinf(), full.isinf())
    assert torch.equal(fast[~fast.isinf()], logits[~fast.isinf()])


# --- grammar masks --------------------------------------------------------------


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[N, V] bool -> llguidance's packed words: token t is bit t % 32 of int32 word t // 32."""
    packed = np.packbits(allowed.numpy(), axis=1, bitorder="little")
    words = np.zeros((allowed.shape[0], -(-allowed.shape[1] // 32) * 4), dtype=np.uint8)
    words[:, : packed.shape[1]] = packed
    return torch.from_numpy(words.view(np.int32))


@pytest.mark.parametrize("temperatures", [[0.0] * 4, [0.7, 1.0, 1.3, 0.5], [0.0, 0.8, 0.0, 1.2]])
def test_mask_applied_after_scoring_picks_what_masking_first_picks(temperatures) -> None:
    """Without probability filters the grammar mask may come after the rest of sampling (it is still
    being filled while that runs): the same seeds give the same tokens as masking the logits first,
    every token allowed, and the rest of the distribution untouched."""
    vocab = 300
    logits = random_logits(4, vocab, seed=3)
    allowed = torch.rand(4, vocab, generator=_gen(4)) < 0.1
    params = [SamplingParams(temperature=t, seed=50 + i) for i, t in enumerate(temperatures)]
    first = make_batch(params, vocab)
    assert first.mask_can_wait
    first.token_bitmask = _bitmask(allowed)
    masked_logits = logits.clone().masked_fill_(~allowed, float("-inf"))
    expected = Sampler()(masked_logits, make_batch(params, vocab)).sampled_token_ids
    sampler = Sampler()
    scores = sampler.score(logits.clone(), make_batch(params, vocab))  # no mask yet
    late = make_batch(params, vocab)
    late.token_bitmask = first.token_bitmask
    got = sampler.pick(scores, late).sampled_token_ids
    assert torch.equal(got, expected)
    assert allowed[torch.arange(4), got].all()


def test_probability_filters_see_only_the_allowed_tokens() -> None:
    """top-p renormalises over what the grammar allows, so with a filter the mask comes first: a row
    whose nucleus holds only banned tokens still samples an allowed one."""
    vocab = 64
    logits = torch.full((1, vocab), -10.0)
    logits[0, 0] = 10.0  # the whole nucleus under top_p=0.5, and banned
    allowed = torch.zeros(1, vocab, dtype=torch.bool)
    allowed[0, 10:20] = True
    batch = make_batch([SamplingParams(temperature=1.0, top_p=0.5, seed=1)], vocab)
    assert not batch.mask_can_wait
    batch.token_bitmask = _bitmask(allowed)
    token = Sampler()(logits, batch).sampled_token_ids[0]
    assert 10 <= token < 20
