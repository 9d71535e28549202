"""Incremental detokenization: streamed deltas must equal the full decode, never split a character."""

from __future__ import annotations

import pytest

from ember.engine.output import IncrementalDetokenizer
from ember.sampling.params import SamplingParams

TEXTS = [
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "Emoji: 🙂🎉👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 mixed with text.",
    "Ünïcödé àccents, ελληνικά, русский, עברית, العربية, 日本語のテキスト。",
    "def f(x):\n    return x ** 2  # 平方\n",
]


@pytest.fixture(scope="module")
def tokenizer(default_llm):
    return default_llm.get_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_equal_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > 5
    prompt = tokenizer.encode("Translate:")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas = []
    for tid in ids:
        assert detok.update(tid) is None
        delta = detok.take_delta(finished=False)
        assert "\ufffd" not in delta
        deltas.append(delta)
    detok.flush()
    deltas.append(detok.take_delta(finished=True))
    assert "".join(deltas) == tokenizer.decode(ids) == text
    # Multi-byte characters really were split across tokens, so the test exercised the hold-back.
    assert any(d == "" for d in deltas[:-1])


def test_stop_string_spanning_tokens_is_held_back(tokenizer):
    text = "Hello world, this is the END of the story."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["the END"]))
    streamed = ""
    stop = None
    for tid in ids:
        stop = detok.update(tid)
        streamed += detok.take_delta(finished=stop is not None)
        if stop:
            break
    assert stop == "the END"
    assert streamed == detok.text == "Hello world, this is "


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>", add_special_tokens=False)
    for skip, expected in ((True, "assistant\nHi"), (False, "<|im_start|>assistant\nHi<|im_end|>")):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
        for tid in ids:
            detok.update(tid)
        detok.flush()
        assert detok.take_delta(finished=True) == expected
