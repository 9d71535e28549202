"""Incremental detokenization: streamed deltas must equal the full decode, never split a character."""

from __future__ import annotations

import pytest

from ember.frontend.output import IncrementalDetokenizer
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
    assert stop == ("stop", "the END")
    assert streamed == detok.text == "Hello world, this is "


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>", add_special_tokens=False)
    for skip, expected in ((True, "assistant\nHi"), (False, "<|im_start|>assistant\nHi<|im_end|>")):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
        for tid in ids:
            detok.update(tid)
        detok.flush()
        assert detok.take_delta(finished=True) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_rebuild_the_utf8_text(tokenizer, text):
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some tokens are partial characters
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == text.encode("utf-8")


def test_token_bytes_of_sentencepiece_pieces():
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTokenizer

    from ember.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "</s>": 1, "\u2581hello": 2, "<0xE4>": 3, "<0xBD>": 4, "<0xA0>": 5, "x": 6}
    tok = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    wrapped = Tokenizer(tok, bos_token=None, eos_token="</s>", eos_token_ids=[1], chat_template=None)
    assert wrapped.token_bytes(2) == b" hello"
    assert b"".join(wrapped.token_bytes(i) for i in (3, 4, 5)) == "你".encode()
    assert wrapped.token_bytes(1) == b"</s>"
    assert wrapped.token_bytes(6) == b"x"
