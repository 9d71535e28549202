"""`--reasoning-parser`: `<think>...</think>` into reasoning_content, on scripted token streams (tags
split across tokens and across chunks), whole answers, and through a server's chat endpoint."""

from __future__ import annotations

import random
import re

import pytest
from conftest import DEVICE, token_pieces
from test_server import MODEL, ServerThread

from ember import AsyncLLM, EngineArgs
from ember.core.grammar import GrammarManager
from ember.model.files import load_model_info
from ember.sampling.structured import StructuredOutputsParams
from ember.server.chat_answer import AnswerParser
from ember.server.reasoning import REASONING_PARSERS, ReasoningParser, split_reasoning

CASES = [  # (parser, answer, reasoning, content)
    (
        "qwen3",
        "<think>\nThe user wants a greeting.\n</think>\n\nHello there!",
        "\nThe user wants a greeting.\n",
        "Hello there!",
    ),
    ("qwen3", "Hello there, no thinking.", None, "Hello there, no thinking."),
    ("qwen3", "  <think>a < b and c </thin k></think>x</think>", "a < b and c </thin k>", "x</think>"),
    ("qwen3", "<think>cut off before the end", "cut off before the end", ""),
    ("qwen3", "<thin", None, "<thin"),
    (
        "deepseek_r1",
        "Let me think: 2 + 2 = 4.</think>\n\nThe answer is 4.",
        "Let me think: 2 + 2 = 4.",
        "The answer is 4.",
    ),
    ("deepseek_r1", "<think>repeated tag</think>answer", "repeated tag", "answer"),
    ("deepseek_r1", "only reasoning, cut off", "only reasoning, cut off", ""),
]


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer


def _stream(name: str, pieces: list[str]) -> tuple[str | None, str]:
    parser = ReasoningParser(REASONING_PARSERS[name])
    reasoning = content = ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    reasoning, content = reasoning + r, content + c
    return (reasoning if parser.thought or reasoning else None), content


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_whole_token_and_chunk_streams_agree(name, text, reasoning, content, tokenizer):
    assert split_reasoning(REASONING_PARSERS[name], text) == (reasoning, content)
    pieces = token_pieces(tokenizer, text)
    assert _stream(name, pieces) == (reasoning, content)
    assert _stream(name, list(text)) == (reasoning, content)  # one character at a time
    rng = random.Random(1)
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _stream(name, chunks) == (reasoning, content)


def test_no_partial_tag_is_ever_shown(tokenizer):
    text = "<think>abc</think>def"
    for name in REASONING_PARSERS:
        for pieces in (token_pieces(tokenizer, text), list(text)):
            parser = ReasoningParser(REASONING_PARSERS[name])
            for piece in pieces:
                reasoning, content = parser.feed(piece)
                assert "<" not in reasoning + content and ">" not in reasoning + content


def test_answer_parser_without_tools():
    parser = AnswerParser(REASONING_PARSERS["deepseek_r1"], None)
    delta = parser.feed("why</th") + parser.feed("ink>because") + parser.finish()
    assert (delta.reasoning, delta.content, delta.tool_calls) == ("why", "because", [])


# ---- through the server ---------------------------------------------------------------------

# Qwen3's way: with enable_thinking false the template writes an empty think block itself.
TEMPLATE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("reasoning") / "template.jinja"
    template.write_text(TEMPLATE)
    args = EngineArgs(
        kv_cache_memory=0.1,
        max_model_len=512,
        device=DEVICE,
        dtype="float32",
        chat_template=str(template),
        engine_process=False,
    )
    with ServerThread(AsyncLLM(args, served_model_name=MODEL), reasoning_parser="qwen3") as s:
        yield s


def test_server_reasoning_content_and_template_kwargs(server):
    """With thinking off (the template closed the think block), a grammar holds from the first token:
    here it makes the small model write a think block, and the answer splits, streamed or not."""
    client = server.client(timeout=120)
    pattern = r"<think>[a-z ]{1,12}</think>[A-Z][a-z]{1,8}"
    kwargs = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "temperature": 0,
        "max_tokens": 40,
        "extra_body": {"structured_outputs": {"regex": pattern}, "chat_template_kwargs": {"enable_thinking": False}},
    }
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert re.fullmatch(r"[a-z ]{1,12}", reasoning) and re.fullmatch(r"[A-Z][a-z]{1,8}", message.content)
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta.model_dump()
        for key in streamed:
            streamed[key] += delta.get(key) or ""
    assert streamed == {"reasoning_content": reasoning, "content": message.content}
    thinking = client.chat.completions.create(**{**kwargs, "extra_body": {"chat_template_kwargs": {}}, "max_tokens": 1})
    assert whole.usage.prompt_tokens - thinking.usage.prompt_tokens == len(
        load_model_info(EngineArgs().load_config()).tokenizer.encode(
            "<think>\n\n</think>\n\n", add_special_tokens=False
        )
    )


def test_server_constraint_waits_for_the_end_of_thinking(server):
    """With thinking on, a choice constraint leaves the think block free: the small model never closes
    it within the budget, so the answer runs to max_tokens instead of being one of the choices."""
    client = server.client(timeout=120)
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        max_tokens=12,
        extra_body={"structured_outputs": {"choice": ["Yes", "No"]}},
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12


def test_think_first_grammar(tokenizer):
    """The wrapped grammar: free text up to the first </think>, optional whitespace, then the
    constraint, complete at its end; the constraint is enforced after the block."""
    manager = GrammarManager(EngineArgs().load_config(), tokenizer.vocab_size)
    params = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, after_think=True
    )
    for text, ok in [
        ('<think>hmm {"b": 1} is it?</think>\n\n{"a": 42}', True),
        ('<think>x</think>{"b": 1}', False),
        ('<think>one</think> two </think>{"a": 1}', False),
    ]:
        matcher = manager.matcher(params)
        accepted = all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        assert accepted == ok and matcher.is_accepting() == ok, text
    manager.shutdown()
