"""Tool calling: the four text formats on scripted answers (whole, token by token, in random chunks),
and on a real server (default model, official `openai` client): required and named tools enforced
by grammar, streamed deltas that reassemble to the same calls, a round trip with a tool message."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from api_fixtures import TEMPLATE, serve_default_model
from conftest import token_pieces
from test_server import MODEL

from ember.server.chat_answer import AnswerParser, ToolMode
from ember.server.reasoning import REASONING_PARSERS
from ember.server.tool_parsers import TOOL_PARSERS, ToolCallStream, parse_tool_calls, parser_for_template

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}

SCRIPTED = {
    "hermes": (
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        "Let me check.",
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}',
        "",
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        "",
    ),
    "pythonic": ('[get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]', ""),
}
EXPECTED = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer


def _random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _streamed(fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    stream = ToolCallStream(TOOL_PARSERS[fmt])
    content, names, args = "", {}, {}
    for piece in [*pieces, None]:
        text, deltas = stream.finish() if piece is None else stream.feed(piece)
        content += text
        for d in deltas:
            if d.id is not None:  # id and name come first, alone
                assert d.name and d.arguments == "" and d.index not in names
                names[d.index] = d.name
            else:
                assert d.index in names
                args[d.index] = args.get(d.index, "") + d.arguments
    return content, [(names[i], json.loads(args[i])) for i in sorted(names)]


@pytest.mark.parametrize("fmt", sorted(SCRIPTED))
def test_formats_whole_and_streamed(fmt, tokenizer):
    text, content = SCRIPTED[fmt]
    whole_content, calls = parse_tool_calls(TOOL_PARSERS[fmt], text)
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED
    assert _streamed(fmt, token_pieces(tokenizer, text)) == (content, EXPECTED)
    rng = random.Random(0)
    for _ in range(5):
        assert _streamed(fmt, _random_chunks(text, rng)) == (content, EXPECTED)


@pytest.mark.parametrize("fmt", sorted(SCRIPTED))
def test_plain_answers_stay_content(fmt, tokenizer):
    for text in ("The weather in Paris is mild.", "[1, 2] is a list; {not json}", "Use <tool for it"):
        assert parse_tool_calls(TOOL_PARSERS[fmt], text) == (text, [])
        assert _streamed(fmt, token_pieces(tokenizer, text)) == (text, [])


def test_parser_picked_from_template():
    assert parser_for_template(TEMPLATE) == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template("{{ messages }}") is None


def test_reasoning_then_tool_calls():
    """Tool calls are read after the think block only: a call inside the reasoning is not one."""
    text = '<think>maybe <tool_call>{"name": "x", "arguments": {}}</tool_call>?</think>\n\n' + SCRIPTED["hermes"][0]
    parser = AnswerParser(REASONING_PARSERS["qwen3"], ToolMode("auto", fmt=TOOL_PARSERS["hermes"]))
    delta = parser.feed(text[:7])
    for i in range(7, len(text), 5):
        delta = delta + parser.feed(text[i : i + 5])
    delta = delta + parser.finish()
    assert delta.reasoning == 'maybe <tool_call>{"name": "x", "arguments": {}}</tool_call>?'
    assert delta.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == EXPECTED


# ---- on a server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_default_model(tmp_path_factory) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=120)


QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time in Paris?"}]


def _stream_calls(chunks) -> tuple[list[tuple[str, str]], str]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in chunks:
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            else:
                calls[d.index][1] += d.function.arguments
        finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tools_validate_and_stream_the_same(client, tool_choice):
    kwargs = {
        "model": MODEL,
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "temperature": 0,
        "max_tokens": 80,
    }
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == ["get_time"]
    streamed, finish = _stream_calls(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in streamed] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]


def test_parallel_tool_calls_false_gives_one_call(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    assert len(out.choices[0].message.tool_calls) == 1


def test_round_trip_with_tool_message(server, client):
    first = (
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=TOOLS,
            temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=80,
        )
        .choices[0]
        .message
    )
    call = first.tool_calls[0]
    messages = [
        *QUESTION,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    rendered = server.post("/tokenize", {"model": MODEL, "messages": messages}).json()
    text = server.post("/detokenize", {"model": MODEL, "tokens": rendered["tokens"]}).json()["prompt"]
    assert "<tool_response>18 degrees and sunny</tool_response>" in text
    assert f'"name": "get_weather", "arguments": {json.dumps(json.loads(call.function.arguments))}' in text
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=24
    )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_tool_errors(server):
    base = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 8}
    r = server.post("/v1/chat/completions", {**base, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = server.post(
        "/v1/chat/completions", {**base, "tool_choice": "required", "response_format": {"type": "json_object"}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    bad = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}},
        }
    ]
    r = server.post("/v1/chat/completions", {**base, "tools": bad, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
