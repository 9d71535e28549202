"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the official `anthropic`
client on a real server of the default model: whole and streamed answers that agree, tool_use /
tool_result round trips, stop sequences, structured output, token counts, both auth headers, and
malformed bodies answered 400 in Anthropic's error shape with nothing left behind. The block writer is
also checked on scripted answers with thinking, text and tool calls."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from api_fixtures import assert_no_request_left, serve_default_model, sse_events
from test_server import MODEL
from test_tool_calls import SCHEMAS, TOOLS

from ember.sampling.params import SamplingParams
from ember.server.anthropic_messages import _Message, stop_reason
from ember.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from ember.server.chat_answer import AnswerDelta
from ember.server.conversation import ChoiceEvent
from ember.server.tool_parsers import ToolCallDelta

TOOLS_ANTHROPIC = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
GREEDY = {"extra_body": {"temperature": 0}}
AUTH = {"x-api-key": "key-a"}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    with serve_default_model(tmp_path_factory, api_keys=("key-a", "key-b")) as s:
        yield s


@pytest.fixture(scope="module")
def client(tool_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tool_server.url, api_key="key-a", max_retries=0, timeout=120)


def test_create_and_stream_agree(client, tool_server):
    kwargs = dict(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Say hello"}], **GREEDY)
    whole = client.messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.id.startswith("msg_") and [b.type for b in whole.content] == ["text"]
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    counted = client.messages.count_tokens(model=MODEL, messages=kwargs["messages"]).input_tokens
    assert whole.usage.input_tokens == counted > 0
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == whole.content[0].text
    assert (streamed.stop_reason, streamed.usage.output_tokens) == ("max_tokens", 12)


def test_stream_events_in_order_with_named_sse(tool_server):
    body = {"model": MODEL, "max_tokens": 6, "stream": True, "temperature": 0, "messages": QUESTION}
    with httpx.stream("POST", tool_server.url + "/v1/messages", json=body, headers={"x-api-key": "key-a"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    kinds = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)  # each `event:` line names its data
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"] == {"output_tokens": 6}
    assert all(data.get("index", 0) == 0 for _, data in events)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}])
def test_forced_tool_use_validates_and_streams_the_same(client, choice):
    kwargs = dict(model=MODEL, max_tokens=80, messages=QUESTION, tools=TOOLS_ANTHROPIC, tool_choice=choice, **GREEDY)
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and all(b.id and b.name in SCHEMAS for b in uses)
    for b in uses:
        jsonschema.validate(b.input, SCHEMAS[b.name])
    if choice["type"] == "tool":
        assert [b.name for b in uses] == ["get_time"]
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(b.name, b.input) for b in uses]


def test_disable_parallel_tool_use_gives_one_call(client):
    choice = {"type": "any", "disable_parallel_tool_use": True}
    message = client.messages.create(
        model=MODEL, max_tokens=80, messages=QUESTION, tools=TOOLS_ANTHROPIC, tool_choice=choice, **GREEDY
    )
    assert len([b for b in message.content if b.type == "tool_use"]) == 1


def test_tool_use_tool_result_round_trip(client, tool_server):
    first = client.messages.create(
        model=MODEL,
        max_tokens=80,
        messages=QUESTION,
        tools=TOOLS_ANTHROPIC,
        tool_choice={"type": "tool", "name": "get_weather"},
        **GREEDY,
    )
    use = next(b for b in first.content if b.type == "tool_use")
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees and sunny"}
    reply = [b.model_dump(exclude_none=True) for b in first.content]
    messages = [*QUESTION, {"role": "assistant", "content": reply}, {"role": "user", "content": [result]}]
    # The template sees the call and its result where the chat API would put them.
    body = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 1, "messages": messages})
    chat = body.chat_messages()
    assert chat[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": use.input}
    assert chat[2] == {"role": "tool", "tool_call_id": use.id, "content": "18 degrees and sunny"}
    rendered = tool_server.post("/tokenize", {"model": MODEL, "messages": chat}, headers=AUTH).json()["tokens"]
    text = tool_server.post("/detokenize", {"model": MODEL, "tokens": rendered}, headers=AUTH).json()["prompt"]
    assert "<tool_response>18 degrees and sunny</tool_response>" in text
    answer = client.messages.create(model=MODEL, max_tokens=16, messages=messages, tools=TOOLS_ANTHROPIC, **GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content


def test_count_tokens_counts_system_and_tools(client, tool_server):
    plain = client.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens
    with_system = client.messages.count_tokens(model=MODEL, messages=QUESTION, system="Be brief.").input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=QUESTION, tools=TOOLS_ANTHROPIC).input_tokens
    chat = [{"role": "user", "content": QUESTION[0]["content"]}]
    assert plain == tool_server.post("/tokenize", {"model": MODEL, "messages": chat}, headers=AUTH).json()["count"]
    assert with_system > plain and with_tools > plain + 20


def test_stop_sequence_is_reported(client):
    kwargs = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Say hello"}], **GREEDY)
    text = client.messages.create(**kwargs).content[0].text
    word = text.split()[2]
    stopped = client.messages.create(stop_sequences=[word], **kwargs)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
    assert stopped.content[0].text == text[: text.index(word)]


def test_output_config_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    message = client.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=[{"role": "user", "content": "Name a city as JSON"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        **GREEDY,
    )
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_auth_headers_and_anthropic_error_shape(tool_server):
    ok = {"model": MODEL, "max_tokens": 2, "messages": QUESTION}
    assert tool_server.post("/v1/messages", ok, headers={"x-api-key": "key-b"}).status_code == 200
    assert tool_server.post("/v1/messages", ok, headers={"Authorization": "Bearer key-a"}).status_code == 200
    for headers in ({}, {"x-api-key": "nope"}, {"Authorization": "Bearer nope"}):
        r = tool_server.post("/v1/messages", ok, headers=headers)
        assert r.status_code == 401
        assert r.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": r.json()["error"]["message"]},
        }
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=tool_server.url, api_key="nope", max_retries=0).messages.create(**ok)
    # The OpenAI endpoints take Anthropic's header too, and keep their own error shape.
    r = tool_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers={"x-api-key": "key-b"})
    assert r.status_code == 200
    assert "type" not in tool_server.post("/v1/completions", {"prompt": "hi"}).json()


MALFORMED = [
    ("not json", None),
    ("[1, 2]", None),
    ({}, "messages"),
    ({"messages": QUESTION}, "max_tokens"),
    ({"max_tokens": 5}, "messages"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 0, "messages": QUESTION}, "max_tokens"),
    ({"max_tokens": -3, "messages": QUESTION}, "max_tokens"),
    ({"max_tokens": 2**70, "messages": QUESTION}, "max_tokens"),
    ({"max_tokens": "many", "messages": QUESTION}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user"}]}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    ({"max_tokens": 5, "messages": "hi"}, "messages"),
    ({"max_tokens": 5, "messages": ["hi"]}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages"),
    (
        {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
        "messages",
    ),
    (
        {
            "max_tokens": 5,
            "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}],
        },
        "messages",
    ),
    ({"max_tokens": 5, "messages": QUESTION, "system": 5}, "system"),
    ({"max_tokens": 5, "messages": QUESTION, "thinking": {"type": "sometimes"}}, "thinking"),
    ({"max_tokens": 5, "messages": QUESTION, "tools": [{"name": "f", "input_schema": "object"}]}, "tools"),
    ({"max_tokens": 5, "messages": QUESTION, "tools": [{"name": "", "input_schema": {}}]}, "tools"),
    ({"max_tokens": 5, "messages": QUESTION, "tools": [{"name": "f" * 129, "input_schema": {}}]}, "tools"),
    ({"max_tokens": 5, "messages": QUESTION, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 5, "messages": QUESTION, "temperature": -1}, "temperature"),
    ({"max_tokens": 5, "messages": QUESTION, "top_p": 0}, "top_p"),
    ({"max_tokens": 5, "messages": QUESTION, "top_k": -2}, "top_k"),
    ({"max_tokens": 5, "messages": QUESTION, "stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 5, "messages": QUESTION, "stop_sequences": "END"}, "stop_sequences"),
    ({"max_tokens": 5, "messages": QUESTION, "system": [{"type": "image"}]}, "system"),
    ({"max_tokens": 5, "messages": QUESTION, "tools": [{"name": "f"}]}, "tools"),
    (
        {"max_tokens": 5, "messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        "tools",
    ),
    ({"max_tokens": 5, "messages": QUESTION, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": QUESTION, "tools": TOOLS_ANTHROPIC, "tool_choice": {"type": "tool"}}, "tool_choice"),
    (
        {"max_tokens": 5, "messages": QUESTION, "tools": TOOLS_ANTHROPIC, "tool_choice": {"type": "tool", "name": "x"}},
        "tool_choice",
    ),
    ({"max_tokens": 5, "messages": QUESTION, "output_config": {"format": {"type": "json_schema"}}}, "output_config"),
    (
        {
            "max_tokens": 5,
            "messages": QUESTION,
            "output_config": {"format": {"type": "json_schema", "schema": {"type": 7}}},
        },
        "output_config",
    ),
    ({"max_tokens": 5, "messages": QUESTION, "model": "claude-unknown"}, "model"),
    ({"max_tokens": 5000, "messages": QUESTION}, "max_tokens"),
]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_malformed_bodies_are_anthropic_400s_and_leave_nothing(tool_server, path):
    headers = AUTH
    cases = [(b, p) for b, p in MALFORMED if path == "/v1/messages" or p not in _SAMPLING_FIELDS]
    assert len(cases) >= 20
    for body, param in cases:
        if isinstance(body, str):
            r = httpx.post(tool_server.url + path, content=body, headers=headers, timeout=60)
        else:
            r = tool_server.post(path, {"model": MODEL, **body}, headers=headers)
        expected = 404 if param == "model" else 400
        assert r.status_code == expected, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, err
        assert err["error"]["type"] == ("not_found_error" if expected == 404 else "invalid_request_error")
        if param is not None:
            assert param in err["error"]["message"], (param, err)
    assert_no_request_left(tool_server)


_SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "output_config"}


# ---- the block writer, on scripted answers -------------------------------------------------------


class _ScriptedRun:
    """What `_Message` reads of a chat run, with events given by the test."""

    request_id = "msg_test"
    prompt_tokens = 7

    def __init__(self, events: list[ChoiceEvent]) -> None:
        self._events = events

    async def events(self):
        for e in self._events:
            yield e

    def usage(self):
        from ember.server.protocol import UsageInfo

        return UsageInfo(prompt_tokens=7, completion_tokens=9, total_tokens=16)


def _stream(events: list[ChoiceEvent]) -> list[dict]:
    import asyncio

    body = MessagesRequest.model_validate({"max_tokens": 9, "messages": QUESTION})

    async def collect():
        return [e.model_dump() async for e in _Message(MODEL, body, _ScriptedRun(events)).events()]  # type: ignore[arg-type]

    return asyncio.run(collect())


def test_thinking_text_and_tool_blocks_stream_in_order():
    events = [
        ChoiceEvent(0, AnswerDelta(reasoning="Let me"), [1], None),
        ChoiceEvent(0, AnswerDelta(reasoning=" think.", content="Calling"), [2], None),
        ChoiceEvent(
            0,
            AnswerDelta(content=" now.", tool_calls=[ToolCallDelta(0, id="call_1", name="f", arguments="")]),
            [3],
            None,
        ),
        ChoiceEvent(0, AnswerDelta(tool_calls=[ToolCallDelta(0, arguments='{"a": 1}')]), [4], None),
        ChoiceEvent(0, AnswerDelta(tool_calls=[ToolCallDelta(1, id="call_2", name="g", arguments="{}")]), [5], None),
        ChoiceEvent(0, AnswerDelta(), [], None, finish_reason="tool_calls"),
    ]
    out = _stream(events)
    shape = [(e["type"], e.get("index"), (e.get("content_block") or e.get("delta") or {}).get("type")) for e in out]
    assert shape == [
        ("message_start", None, None),
        ("ping", None, None),
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"),
        ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert out[-2]["delta"]["stop_reason"] == "tool_use" and out[-2]["usage"] == {"output_tokens": 9}
    assert out[10]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}


def test_stop_reasons_map():
    assert stop_reason("length", None) == ("max_tokens", None)
    assert stop_reason("stop", 2) == ("end_turn", None)
    assert stop_reason("stop", "END") == ("stop_sequence", "END")
    assert stop_reason("tool_calls", None) == ("tool_use", None)
    assert stop_reason("content_filter", None) == ("refusal", None)


def test_messages_map_onto_chat_turns():
    body = CountTokensRequest.model_validate(
        {
            "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "text", "text": "ok"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "42"}]},
                        {"type": "tool_result", "tool_use_id": "t2", "content": "no", "is_error": True},
                        {"type": "text", "text": "thanks"},
                    ],
                },
            ],
            "thinking": {"type": "disabled"},
        }
    )
    assert body.chat_messages() == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "x\n\ny"},
        {
            "role": "assistant",
            "content": "ok",
            "reasoning_content": "hmm",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: no"},
        {"role": "user", "content": "thanks"},
    ]
    assert body.template_kwargs() == {"enable_thinking": False}


def test_ignore_eos_reaches_the_sampling_params():
    """vLLM's extension, as on the OpenAI endpoints: `ember bench serve` sends it so every API generates alike."""
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    assert not MessagesRequest.model_validate(body).to_sampling_params(SamplingParams()).ignore_eos
    assert MessagesRequest.model_validate({**body, "ignore_eos": True}).to_sampling_params(SamplingParams()).ignore_eos
