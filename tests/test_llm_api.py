"""The offline `LLM` API: vLLM-compatible inputs and outputs, sampling behaviour end to end, and errors."""

from __future__ import annotations

import pytest

from ember import LLM, SamplingParams
from ember.core.request import RequestStatus


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), kv_cache_memory=0.05, max_model_len=512)


def _ids(n: int, start: int = 5) -> dict:
    return {"prompt_token_ids": [start + (i * 7) % 500 for i in range(n)]}


def test_outputs_in_input_order_with_prompt_fields(llm):
    prompts = ["The quick brown fox", _ids(50), "Paris is the capital of", _ids(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert [o.prompt for o in outs] == ["The quick brown fox", None, "Paris is the capital of", None]
    assert outs[0].prompt_token_ids == tok.encode("The quick brown fox")
    assert outs[1].prompt_token_ids == prompts[1]["prompt_token_ids"]
    for o in outs:
        assert o.finished and len(o.outputs) == 1
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids)
    # Each prompt alone gives the same as inside the batch.
    alone = llm.generate(prompts[2], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_per_prompt_sampling_params(llm):
    outs = llm.generate(
        [_ids(10), _ids(10)],
        [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=7, ignore_eos=True)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([_ids(3), _ids(3)], [SamplingParams()], use_tqdm=False)


def test_n_outputs_and_seeds(llm):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    out = llm.generate(_ids(20), params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) > 1, "n samples with different child seeds should differ"
    again = llm.generate(_ids(20), params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == seqs


def test_seed_is_independent_of_batch_mates(llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate(_ids(30), seeded, use_tqdm=False)[0].outputs[0].token_ids
    mates = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 5
    outs = llm.generate(
        [_ids(9, 11), _ids(40, 3), _ids(30), _ids(5), _ids(17, 2), _ids(60)],
        mates[:2] + [seeded] + mates[2:],
        use_tqdm=False,
    )
    assert outs[2].outputs[0].token_ids == alone


def test_unseeded_sampling_varies(llm):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([_ids(12)] * 4, params, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_stop_token_ids_and_min_tokens(llm):
    base = (
        llm.generate(_ids(25), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    stop_tok = base[5]
    first = base.index(stop_tok)
    out = llm.generate(
        _ids(25),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == base[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens forbids the stop token until enough tokens exist.
    out = llm.generate(
        _ids(25),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok], min_tokens=first + 3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= first + 3
    assert stop_tok not in out.token_ids[: first + 2]


# ---- logit_bias, allowed_token_ids, bad_words, min_tokens ------------------------------------

EOS = 2  # the tiny checkpoints' eos_token_id


def _greedy(llm, prompt, max_tokens: int = 12, **params):
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params), use_tqdm=False)
    return out[0].outputs[0]


def _occurs(seq: list[int], tokens: list[int]) -> bool:
    return any(tokens[i : i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


def _first_completion(sequences: list[list[int]], tokens: list[int]) -> int | None:
    """The first position whose token would complete one of the sequences (vLLM's bad-words rule)."""
    for k in range(len(tokens)):
        if any(tokens[max(0, k - len(s) + 1) : k + 1] == s for s in sequences if len(s) <= k + 1):
            return k
    return None


def test_logit_bias_end_to_end(llm):
    forced = _greedy(llm, _ids(25), max_tokens=8, logit_bias={100: 100})
    assert forced.token_ids == [100] * 8
    base = _greedy(llm, _ids(25), max_tokens=8, ignore_eos=True).token_ids
    banned = _greedy(llm, _ids(25), max_tokens=8, ignore_eos=True, logit_bias={base[0]: -100}).token_ids
    assert banned[0] != base[0]
    # Per request: a batch mate without logit_bias keeps its own answer.
    both = llm.generate(
        [_ids(25), _ids(25)],
        [
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=8, logit_bias={100: 100}),
        ],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in both] == [base, [100] * 8]


def test_allowed_token_ids_end_to_end(llm):
    allowed = [10, 20, 30, 40, 300]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed)
        for i in range(3)
    ]
    params.append(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed))
    params.append(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    outs = [
        o.outputs[0].token_ids
        for o in llm.generate([_ids(12), _ids(30, 3), _ids(7), _ids(25), _ids(25)], params, use_tqdm=False)
    ]
    for tokens in outs[:4]:
        assert len(tokens) == 16 and set(tokens) <= set(allowed)
    assert len({t for tokens in outs[:3] for t in tokens}) > 1  # sampling still chooses among them
    assert not set(outs[4]) <= set(allowed)  # the unrestricted answer would have left the set


def test_bad_words_end_to_end(llm):
    """A word from the greedy answer, tokenized by the front end as vLLM does: its token sequences
    never appear, and the answer is the same up to where one would have been completed."""
    prompt = _ids(25)
    base = _greedy(llm, prompt, max_tokens=20, ignore_eos=True).token_ids
    tok = llm.get_tokenizer()
    # Two consecutive answer tokens, from the fourth on, that are how their text tokenizes.
    start, word = next(
        (i, text)
        for i in range(3, len(base) - 1)
        for text in [tok.decode(base[i : i + 2])]
        if tok.encode(text.lstrip(), add_special_tokens=False) == base[i : i + 2]
    )
    sequences = llm.llm_engine.processor.bad_words_token_ids(SamplingParams(bad_words=[word]))
    assert base[start : start + 2] in sequences and all(len(s) == 2 for s in sequences)
    cut = _first_completion(sequences, base)
    assert cut is not None and cut <= start + 1
    out = _greedy(llm, prompt, max_tokens=20, ignore_eos=True, bad_words=[word]).token_ids
    assert out[:cut] == base[:cut] and out[cut] != base[cut]
    assert not any(_occurs(s, out) for s in sequences)
    # Token sequences directly: one token banned everywhere, a pair only after its first token.
    out = _greedy(llm, prompt, max_tokens=20, ignore_eos=True, bad_words_token_ids=[[base[0]]]).token_ids
    assert base[0] not in out
    pair = base[start : start + 2]
    out = _greedy(llm, prompt, max_tokens=20, ignore_eos=True, bad_words_token_ids=[pair]).token_ids
    assert not _occurs(pair, out) and out[: base.index(pair[1], start)] == base[: base.index(pair[1], start)]


def test_bad_words_are_tokenized_in_the_front_end(llm):
    """The core gets token ids only: bad_words is stripped, like stop strings, and every sequence of the
    request (one per word, plus the word after a space when that is another token of the same length)."""
    tok = llm.get_tokenizer()
    processed = llm.llm_engine.processor.process(
        "bw", _ids(5), SamplingParams(n=2, bad_words=["fox", "Paris"], stop="x")
    )
    assert processed.state.params.bad_words == ["fox", "Paris"]
    expected = []
    for word in ("fox", "Paris"):
        bare, spaced = (tok.encode(w, add_special_tokens=False) for w in (word, " " + word))
        expected.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            expected.append(spaced)
    for core in processed.core_requests:
        assert core.sampling_params.bad_words is None and core.sampling_params.stop == []
        assert core.sampling_params.bad_words_token_ids == expected
    assert [tok.decode(s) for s in expected][:1] == ["fox"]


def test_min_tokens_holds_eos_back(llm):
    eos_first = {EOS: 100.0}  # EOS would be every greedy token
    assert _greedy(llm, _ids(25), logit_bias=eos_first).token_ids == [EOS]
    out = _greedy(llm, _ids(25), logit_bias=eos_first, min_tokens=5)
    assert len(out.token_ids) == 6 and EOS not in out.token_ids[:5] and out.token_ids[5] == EOS
    assert out.finish_reason == "stop"


@pytest.fixture(scope="module")
def async_llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), kv_cache_memory=0.05, max_model_len=512, async_scheduling=True, engine_process=False)


def test_multi_token_bad_words_with_async_scheduling(llm, async_llm):
    """Under async scheduling a step is launched before the last one's tokens reach the host; a request with
    a bad word of several tokens waits for them (as penalties do), so the ban sees the whole output: the
    batch answers as it does one step at a time, beside requests that run ahead."""
    from conftest import inproc_core

    assert inproc_core(async_llm).async_scheduling
    prompts = [_ids(25), _ids(9, 11), _ids(40, 3), _ids(25)]
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    pairs = [b[4:6] for b in base]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words_token_ids=[pairs[0]]),
        plain,
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words_token_ids=[pairs[2], [base[2][0]]]),
        SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, bad_words_token_ids=pairs),
    ]
    sync = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    asynchronous = [o.outputs[0].token_ids for o in async_llm.generate(prompts, params, use_tqdm=False)]
    assert asynchronous == sync
    assert sync[1] == base[1]
    assert not _occurs(pairs[0], sync[0]) and sync[0][:5] == base[0][:5]
    assert not _occurs(pairs[2], sync[2]) and base[2][0] not in sync[2]
    assert not any(_occurs(p, sync[3]) for p in pairs)
    assert inproc_core(async_llm)._num_host_sync == 0


def test_eos_stops_unless_ignored(default_llm):
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    stopped = default_llm.chat(conv, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    eos = default_llm.get_tokenizer().eos_token_ids
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert stopped.token_ids[-1] in eos and len(stopped.token_ids) < 64
    assert "Paris" in stopped.text and "<|im_end|>" not in stopped.text
    n = len(stopped.token_ids)
    ignored = default_llm.chat(conv, SamplingParams(temperature=0, max_tokens=n + 5, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert ignored.token_ids[:n] == stopped.token_ids
    assert len(ignored.token_ids) == n + 5 and ignored.finish_reason == "length"


def test_prefix_cached_prompt_answers_as_the_whole_prompt(default_llm):
    """A prompt whose first blocks (the chat template's system prompt) come from the prefix cache, filled by
    an unrelated conversation, gets the greedy answer it gets when computed whole: the cached blocks and the
    uncached tail are computed in the same float32 arithmetic as the whole prompt (ember/quant/linear.py,
    NATIVE_EXPAND_MIN_ROWS). With bf16 from 16 rows, the default model rambled for 64 tokens here."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=24)
    assert default_llm.llm_engine.reset_prefix_cache()
    whole = default_llm.chat(question, params, use_tqdm=False)[0].outputs[0]
    assert default_llm.llm_engine.reset_prefix_cache()
    default_llm.chat([{"role": "user", "content": "My name is Alice."}], params, use_tqdm=False)
    cached = default_llm.chat(question, params, use_tqdm=False)[0]
    assert cached.num_cached_tokens > 0
    assert cached.outputs[0].token_ids == whole.token_ids and "Paris" in whole.text


def test_logprobs_shape(llm):
    out = llm.generate(_ids(10), SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and lp[tok].rank == 1
        assert 3 <= len(lp) <= 4
        ranks = sorted(v.rank for t, v in lp.items())
        assert ranks[:3] == [1, 2, 3]
        total += lp[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total)
    plain = llm.generate(_ids(10), SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_default_max_tokens_fills_context(llm):
    processed = llm.llm_engine.processor.process("ctx", _ids(500), SamplingParams(max_tokens=None, ignore_eos=True))
    assert [r.max_tokens for r in processed.core_requests] == [12]


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("", SamplingParams(), "prompt"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ({"prompt_token_ids": [1, 2, 10**6]}, SamplingParams(), "prompt_token_ids"),
        ({"prompt_token_ids": [1, "a"]}, SamplingParams(), "prompt_token_ids"),
        ({"nothing": 1}, SamplingParams(), "prompt"),
        (_ids(500), SamplingParams(max_tokens=100), "maximum context length is 512"),
        (_ids(600), SamplingParams(max_tokens=None), "maximum context length"),
        (3.5, SamplingParams(), "prompt"),
        (_ids(3), SamplingParams(logit_bias={5: 1.0, 512: 1.0}), "^logit_bias must be token ids in \\[0, 512\\)"),
        (_ids(3), SamplingParams(allowed_token_ids=[1, 512]), "^allowed_token_ids must be token ids"),
        (_ids(3), SamplingParams(bad_words_token_ids=[[3, 600]]), "^bad_words_token_ids must be token ids"),
    ],
)
def test_invalid_requests_are_rejected(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.scheduler_stats().kv_cache_usage == 0.0


def test_kv_cache_smaller_than_context_is_refused_at_start(llama_dir):
    eight_blocks = 8 * 2 * 2 * 16 * 2 * 16 * 4 / 2**30  # 8 blocks of 16 tokens = 128 tokens
    with pytest.raises(ValueError, match=r"max_model_len \(1024\) is larger than the KV cache can hold \(128 tokens\)"):
        LLM(str(llama_dir), kv_cache_memory=eight_blocks)
    small = LLM(str(llama_dir), kv_cache_memory=eight_blocks, max_model_len=128)
    with pytest.raises(ValueError, match="maximum context length is 128"):
        small.generate(_ids(100), SamplingParams(max_tokens=50), use_tqdm=False)


def test_bad_batch_adds_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate([_ids(5), {"prompt_token_ids": []}], SamplingParams(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_abort_frees_blocks_at_once(llm):
    engine = llm.llm_engine
    rid = engine.add_request(None, _ids(100), SamplingParams(max_tokens=50, ignore_eos=True))
    # The core runs in its own process: a step may return outputs the core sent before it saw the request,
    # so step until a token of this one has come back.
    produced = []
    for _ in range(20):
        produced = [o for o in engine.step() if o.request_id == rid and o.outputs[0].token_ids]
        if produced:
            break
    assert produced and not produced[0].finished
    assert engine.scheduler_stats().kv_cache_usage > 0
    (final,) = engine.abort_request(rid)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert engine.scheduler_stats().kv_cache_usage == 0.0
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_duplicate_request_id(llm):
    engine = llm.llm_engine
    engine.add_request("dup", _ids(5), SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", _ids(5), SamplingParams(max_tokens=2))
    engine.abort_request("dup")


def test_unknown_engine_argument(llama_dir):
    with pytest.raises(TypeError):
        LLM(str(llama_dir), no_such_flag=1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block_size": 12}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"dtype": "int3"}, "dtype"),
        ({"load_format": "pickle"}, "load_format"),
        ({"kv_cache_memory": -1}, "kv_cache_memory"),
    ],
)
def test_bad_engine_arguments(llama_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(llama_dir), **kwargs)


def test_chat_applies_template(default_llm):
    tok = default_llm.get_tokenizer()
    conv = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    out = default_llm.chat(conv, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    expected = tok.apply_chat_template(conv, add_generation_prompt=True)
    assert out.prompt == expected
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    two = default_llm.chat(
        [conv, conv + [{"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another?"}]],
        SamplingParams(temperature=0, max_tokens=8),
        use_tqdm=False,
    )
    assert two[0].outputs[0].token_ids == out.outputs[0].token_ids
    assert "Another?" in two[1].prompt and "Red." in two[1].prompt
    with pytest.raises(ValueError, match="role"):
        default_llm.chat([{"role": "wizard", "content": "hi"}], use_tqdm=False)


def test_stop_strings_cut_text_and_are_never_streamed(default_llm):
    engine = default_llm.llm_engine
    prompt = "Write the numbers from one to twenty in words, separated by commas:"
    base = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = text[20:26]
    assert len(stop.strip()) >= 3, text
    cut = text.find(stop)
    rid = engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=60, stop=[stop, "zzzz"]))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                deltas.append(out.outputs[0].delta_text)
                final = out
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert final.outputs[0].text == text[:cut]
    assert "".join(deltas) == text[:cut]
    assert all(stop not in d for d in deltas)
    incl = default_llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=60, stop=stop, include_stop_str_in_output=True), use_tqdm=False
    )[0]
    assert incl.outputs[0].text == text[: cut + len(stop)]


def test_finished_request_status_values():
    assert {s.value for s in RequestStatus if s.finished} == {"stop", "length", "abort"}


def test_cpu_kv_cache_costs_memory_only_as_used(llama_dir):
    def rss_mib() -> int:
        with open("/proc/self/status") as f:
            return int(f.read().split("VmRSS:")[1].split()[0]) // 1024

    before = rss_mib()
    # In this process, whose memory the test reads. 3 GiB of KV blocks, not capped:
    llm = LLM(str(llama_dir), kv_cache_memory=3.0, max_num_seqs=8192, engine_process=False)
    out = llm.generate(_ids(50), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
    ready = llm.llm_engine.ready
    assert ready.num_blocks * ready.bytes_per_block > (3 << 30) - (1 << 20)
    assert rss_mib() - before < 512
