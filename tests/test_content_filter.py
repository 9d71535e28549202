"""`--blocked-words`: a completion stops before a blocked phrase (case-insensitive, NFKC-normalised), with
finish_reason "content_filter", and no character of the phrase ever streams.

Phrases are cut from what a model generates greedily (an unfiltered run first), so the filter really
fires; the expected text is the unfiltered text up to the phrase's first occurrence. The 100 generated
cases use the default model's text; the server and `LLM` tests a tiny checkpoint, which loads in
well under a second.
"""

from __future__ import annotations

import json
import random
import re
import time

import httpx
import pytest

from ember import LLM, AsyncLLM, EngineArgs, SamplingParams
from ember.engine.content_filter import ContentFilter, Scan, normalize
from ember.engine.messages import EngineCoreOutput, EngineCoreOutputs, Logprobs, SchedulerStats
from ember.engine.output import OutputProcessor, RequestState

from conftest import DEVICE, make_checkpoint
from test_server import ServerThread

MODEL = "tiny"
PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):",
           "My favourite food is", "Water boils at", "The history of Rome began"]
CHAT = [{"role": "user", "content": "Tell me a story about a dragon."}]
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
_STATS = SchedulerStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
                        prefix_cache_hits=0, num_preemptions=0, num_steps=0)


def first_occurrence(text: str, phrases: list[str]) -> int | None:
    """Reference: the first character of `text` from which a blocked phrase starts (normalised)."""
    norm = [normalize(p) for p in phrases]
    for i in range(len(text)):
        rest = normalize(text[i:i + 4 * max(map(len, norm))])
        if any(rest.startswith(p) for p in norm):
            return i
    return None


def fullwidth(s: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in s)


# ---- the matcher ----------------------------------------------------------------------------

@pytest.mark.parametrize("phrase,text,cut,safe_end", [
    ("Hello", "say HELLO there", 4, 4),
    ("ｈｅｌｌｏ", "say Hello", 4, 4),  # full-width phrase, ASCII text
    ("hello", "say ＨＥＬＬＯ", 4, 4),  # and the other way round
    ("café", "un cafe\u0301 noir", 3, 3),  # combining accent in the text
    ("cafe\u0301", "un café noir", 3, 3),  # and in the phrase
    ("ice", "the \ufb01ce", 4, 4),  # the ligature "ﬁ" holds the phrase's first letter: cut before it
    ("STRASSE", "die Straße", 4, 4),  # case folding expands ß
    ("cafe", "un café", None, 3),  # an accent is a different letter, but "caf" + the last character waits
    ("hello", "say hell", None, 4),  # "hell" could still become the phrase
    ("hello", "say ok", None, 5),  # only the last character waits (a combining mark could follow)
    ("hello", "say hi", None, 4),  # "h" waits too: what "i" becomes is not settled yet
])
def test_matching_is_case_insensitive_and_normalised(phrase, text, cut, safe_end):
    assert ContentFilter([phrase]).scan(text, 0) == Scan(cut, safe_end)


def test_phrase_file_ignores_blank_lines_and_surrounding_space(tmp_path):
    path = tmp_path / "blocked.txt"
    path.write_text("  Foo Bar \n\n\t\nBAZ\n", encoding="utf-8")
    assert sorted(ContentFilter.from_file(path).phrases) == ["baz", "foo bar"]
    with pytest.raises(ValueError, match="blocked_words: cannot read"):
        ContentFilter.from_file(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(ValueError, match="blocked_words: no phrases"):
        ContentFilter.from_file(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="blocked_words"):
        EngineArgs(blocked_words=3)  # type: ignore[arg-type]


# ---- the stream, driven by real token ids --------------------------------------------------

def stream(tokenizer, prompt_ids: list[int], token_ids: list[int], phrases: list[str], rng: random.Random,
           logprobs: bool = False, n_steps_max: int = 3) -> tuple[str, list[int], str, RequestState, bool]:
    """Feed `token_ids` to a request as the core would (a few per step) and read it after each step like
    a stream consumer; returns the concatenated text deltas, the streamed token ids, the final
    reason, the request, and whether the core was asked to abort it (or had finished it anyway)."""
    params = SamplingParams(temperature=0, max_tokens=len(token_ids), logprobs=0 if logprobs else None)
    state = RequestState("r", None, prompt_ids, params, tokenizer, 0.0, ContentFilter(phrases))
    processor = OutputProcessor()
    processor.add(state)
    text, streamed_ids, aborted, i = "", [], False, 0
    while not state.finished:
        step = token_ids[i:i + rng.randint(1, n_steps_max)]
        i += len(step)
        lps = None
        if logprobs:
            lps = Logprobs(token_ids=[[t] for t in step], logprobs=[[-1.0] for _ in step], ranks=[1 for _ in step])
        out = EngineCoreOutput("r", step, new_logprobs=lps, finish_reason="length" if i >= len(token_ids) else None)
        processed = processor.process(EngineCoreOutputs([out], 0.0, _STATS))
        aborted |= "r" in processed.to_abort or out.finish_reason is not None
        o = state.output().outputs[0]
        text += o.delta_text
        streamed_ids += o.delta_token_ids
    return text, streamed_ids, o.finish_reason, state, aborted


@pytest.fixture(scope="module")
def tokenizer(default_llm):
    return default_llm.get_tokenizer()


@pytest.fixture(scope="module")
def greedy(default_llm) -> list[tuple[list[int], list[int], str]]:
    """(prompt ids, generated ids, text) of the default model's greedy continuations."""
    outs = default_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


def test_phrase_across_byte_tokens_with_combining_accent(tokenizer):
    """Byte-level tokens split "e\u0301" (and its two UTF-8 bytes) across tokens; the phrase is
    written precomposed and upper case, and nothing of "cafe" streams."""
    ids = tokenizer.encode("We met at the cafe\u0301 near the station.", add_special_tokens=False)
    text, _, reason, state, aborted = stream(tokenizer, [], ids, ["CAFÉ"], random.Random(0), n_steps_max=1)
    assert (text, reason, aborted) == ("We met at the ", "content_filter", True)
    assert "caf" not in tokenizer.decode(state.output().outputs[0].token_ids)


def test_generated_phrases_never_stream_a_character(tokenizer, greedy):
    """The issue's target: over 100 cases, 0 characters of the blocked phrase reach the stream (text,
    token ids or their logprob texts), and the stream is the unfiltered text up to the phrase."""
    rng = random.Random(17)
    fired = 0
    for case in range(100):
        prompt_ids, ids, full = greedy[case % len(greedy)]
        start = rng.randrange(0, len(full) - 3)
        phrase = full[start:start + rng.randint(2, 12)].strip()
        if not normalize(phrase):
            phrase = full[start:].split()[0]
        variant = rng.choice([str, str.upper, str.swapcase, fullwidth, lambda s: fullwidth(s.upper())])(phrase)
        text, streamed_ids, reason, state, aborted = stream(tokenizer, prompt_ids, ids, [variant], rng,
                                                            logprobs=case % 2 == 0)
        cut = first_occurrence(full, [phrase])
        assert cut is not None, (case, phrase)
        assert text == full[:cut], (case, variant)
        assert reason == "content_filter" and aborted, (case, variant)
        final = state.output().outputs[0]
        for shown in (text, tokenizer.decode(streamed_ids), tokenizer.decode(final.token_ids)):
            assert normalize(phrase) not in normalize(shown), (case, variant, shown)
        if final.logprobs is not None:
            assert len(final.logprobs) == len(final.token_ids)
        fired += 1
    assert fired == 100


# ---- through the server -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("filter") / "llama", "llama")


TINY = {"kv_cache_memory": 0.02, "device": DEVICE, "dtype": "float32", "engine_process": False}


@pytest.fixture(scope="module")
def cases(tiny) -> dict[str, tuple[str, str]]:
    """Per endpoint, the unfiltered greedy text and a word from its middle (the server's filter lists them
    as an operator might: upper case, and in full-width letters)."""
    plain = LLM(str(tiny), **TINY)
    completion = plain.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].text
    chat = plain.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0].text
    plain.llm_engine.shutdown()
    out = {}
    for name, full in (("completions", completion), ("chat", chat)):
        words = full.split()
        word = max(words[len(words) // 3:], key=len)  # a word well inside the text
        out[name] = (full, word)
    return out


@pytest.fixture(scope="module")
def server(tiny, cases, tmp_path_factory):
    path = tmp_path_factory.mktemp("filter") / "blocked.txt"
    c_word, h_word = cases["completions"][1], cases["chat"][1]
    path.write_text(f"{c_word.upper()}\n\n  {fullwidth(h_word)}  \n", encoding="utf-8")
    with ServerThread(AsyncLLM(EngineArgs(str(tiny), blocked_words=str(path), **TINY), served_model_name=MODEL)) as s:
        yield s


def _post(server, path: str, body: dict) -> tuple[list[str], list[str], dict]:
    """Texts and finish reasons per choice, whether streamed or not, plus the final usage/response."""
    if not body.get("stream"):
        r = server.post(path, body)
        assert r.status_code == 200, r.text
        data = r.json()
        choices = sorted(data["choices"], key=lambda c: c["index"])
        texts = [c["text"] if "text" in c else c["message"]["content"] for c in choices]
        return texts, [c["finish_reason"] for c in choices], data
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                piece = c["text"] if "text" in c else (c["delta"].get("content") or "")
                texts[c["index"]] = texts.get(c["index"], "") + piece
                if c["finish_reason"] is not None:
                    reasons[c["index"]] = c["finish_reason"]
    return [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(reasons)], {}


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_server_stops_before_the_phrase(server, cases, endpoint, streamed, n):
    full, word = cases[endpoint]
    cut = first_occurrence(full, [word])
    body = {"model": MODEL, "temperature": 0, "max_tokens": 200, "ignore_eos": True, "n": n, "stream": streamed}
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {**body, "messages": CHAT}
    else:
        path, body = "/v1/completions", {**body, "prompt": PROMPTS[0]}
    before = (_metric(server, "ember:request_content_filtered_total"),
              _metric(server, "ember:generation_tokens_total"))
    texts, reasons, data = _post(server, path, body)
    assert texts == [full[:cut]] * n
    assert reasons == ["content_filter"] * n
    # The core was told to stop: far fewer than max_tokens were generated, and every block is free again.
    filtered = _metric(server, "ember:request_content_filtered_total") - before[0]
    generated = _metric(server, "ember:generation_tokens_total") - before[1]
    assert filtered == n
    assert generated < n * (MAX_TOKENS + 4)
    engine = server.state.engine
    deadline = time.monotonic() + 10
    while not (engine.scheduler_stats and engine.scheduler_stats.kv_cache_usage == 0
               and engine.scheduler_stats.num_running == 0):
        assert time.monotonic() < deadline, engine.scheduler_stats
        time.sleep(0.05)
    if data:
        assert data["usage"]["completion_tokens"] <= generated


def test_streamed_logprobs_show_no_part_of_the_phrase(server, cases):
    """Logprobs carry each token's text: they stream only as far as the text did, and a filtered choice
    keeps only the tokens before the cut (as many as the non-streamed answer reports)."""
    word = cases["completions"][1]
    body = {"model": MODEL, "prompt": PROMPTS[0], "temperature": 0, "max_tokens": 200, "ignore_eos": True,
            "logprobs": 1}
    kept = server.post("/v1/completions", body).json()["usage"]["completion_tokens"]
    tokens = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                tokens += lp["tokens"] if lp else []
    assert normalize(word) not in normalize("".join(tokens))
    assert 0 < len(tokens) == kept < MAX_TOKENS


# ---- the library ----------------------------------------------------------------------------

def test_llm_blocked_words_list(tiny, cases):
    """`LLM(blocked_words=[...])`: the synchronous front end stops, aborts and frees blocks the same way."""
    full = cases["completions"][0]
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, n=2)
    phrase = full[len(full) // 2:len(full) // 2 + 4].strip() or full.split()[-1]
    llm = LLM(str(tiny), blocked_words=[fullwidth(phrase.upper())], **TINY)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    cut = first_occurrence(full, [phrase])
    assert [(c.text, c.finish_reason) for c in out.outputs] == [(full[:cut], "content_filter")] * 2
    stats = llm.llm_engine.scheduler_stats()
    assert (stats.num_running, stats.kv_cache_usage) == (0, 0.0)
    assert stats.num_steps < 40  # aborted at the phrase, not run to max_tokens
    llm.llm_engine.shutdown()
