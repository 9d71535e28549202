"""OpenAI's Responses API (`/v1/responses`) through the official `openai` client on a real server of the
default model: whole and streamed answers that agree, numbered typed events, a function-tool round
trip through `previous_response_id` and through explicit items, structured output, logprobs, the
response store (GET, DELETE, per-key isolation, bounds, surviving a restart on disk), background
responses and their cancellation, and malformed bodies answered 400 with nothing left behind."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pytest
from api_fixtures import assert_no_request_left, serve_default_model, sse_events
from test_server import MODEL
from test_tool_calls import SCHEMAS, TOOLS

from ember.sampling.params import SamplingParams
from ember.server.chat_answer import AnswerDelta
from ember.server.conversation import ChoiceEvent
from ember.server.responses import _Response
from ember.server.responses_protocol import InputItems, ResponseObject, ResponsesRequest, chat_messages
from ember.server.responses_store import ResponseStore, StoredResponse, StoreLimits
from ember.server.tool_parsers import ToolCallDelta

FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_default_model(tmp_path_factory, api_keys=("key-a", "key-b")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client(api_key="key-a", timeout=120)


def test_create_and_stream_agree(client):
    kwargs = dict(model=MODEL, input="Say hello", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == MODEL
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in whole.output] == ["message"] and whole.output_text
    assert whole.usage.output_tokens == 12 and whole.usage.total_tokens == whole.usage.input_tokens + 12
    with client.responses.stream(**kwargs) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == whole.output_text and streamed.status == "incomplete"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello"}], max_tokens=12, temperature=0
    )
    assert chat.choices[0].message.content == whole.output_text  # the same request path below HTTP


def test_stream_events_are_typed_and_numbered(server):
    body = {"model": MODEL, "input": "Say hello", "max_output_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers={"x-api-key": "key-b"}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    kinds = [name for name, _ in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert events[-4][1]["text"] == text == events[-1][1]["response"]["output"][0]["content"][0]["text"]
    assert events[0][1]["response"]["status"] == "in_progress"


def test_function_tool_round_trip_with_previous_response_id(client):
    first = client.responses.create(
        model=MODEL, input=QUESTION, tools=FUNCTIONS, tool_choice="required", max_output_tokens=80, temperature=0
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and first.status == "completed"
    for c in calls:
        assert c.call_id and c.id.startswith("fc_")
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "18 degrees"} for c in calls]
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input=outputs, tools=FUNCTIONS, max_output_tokens=8, temperature=0
    )
    assert second.previous_response_id == first.id and second.output
    # The same conversation sent as items, without the store, gives the same answer.
    items = [
        {"role": "user", "content": QUESTION},
        *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls],
        *outputs,
    ]
    explicit = client.responses.create(
        model=MODEL, input=items, tools=FUNCTIONS, max_output_tokens=8, temperature=0, store=False
    )
    assert explicit.output_text == second.output_text
    assert explicit.usage.input_tokens == second.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(explicit.id)  # store: false keeps nothing


def test_named_function_streams_argument_deltas(client):
    kwargs = dict(
        model=MODEL,
        input=QUESTION,
        tools=FUNCTIONS,
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=80,
        temperature=0,
    )
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.name == "get_time" and done.arguments == deltas == whole.output[0].arguments
    jsonschema.validate(json.loads(deltas), SCHEMAS["get_time"])


def test_text_format_json_schema_and_logprobs(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    out = client.responses.create(
        model=MODEL,
        input="Name a city as JSON",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
        max_output_tokens=40,
        temperature=0,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
    )
    jsonschema.validate(json.loads(out.output_text), schema)
    part = out.output[0].content[0]
    assert len(part.logprobs) == out.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)


def test_store_get_delete_and_key_isolation(server, client):
    made = client.responses.create(model=MODEL, input="Say hello", max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    other = server.client(api_key="key-b")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, input="hi", previous_response_id=made.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(made.id)
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_background_response_is_polled_and_cancelled(client):
    bg = client.responses.create(
        model=MODEL, input="Tell a long story", max_output_tokens=1000, temperature=0, background=True
    )
    assert bg.status == "queued" and bg.background
    time.sleep(0.2)
    cancelled = client.responses.cancel(bg.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(bg.id).status == "cancelled"
    done = client.responses.create(model=MODEL, input="Say hi", max_output_tokens=3, temperature=0, background=True)
    deadline = time.monotonic() + 60
    while (polled := client.responses.retrieve(done.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert polled.status == "incomplete" and polled.usage.output_tokens == 3
    assert client.responses.cancel(done.id).status == "incomplete"  # already over: answered as it is
    plain = client.responses.create(model=MODEL, input="Say hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)


MALFORMED = [
    ("not json", None),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": [{"type": "message", "role": "user"}]}, "input"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "computer_call", "id": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 2**70}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "top_p": 2}, "top_p"),
    ({"input": "hi", "top_logprobs": 50}, "top_logprobs"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools"),
    ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "hi", "tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": 7}}}}, "text"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": "hi", "background": True, "stream": True}, "background"),
    ({"input": "hi", "store": "maybe"}, "store"),
    ({"input": "hi", "metadata": {"a": 1}}, "metadata"),
    ({"input": "hi", "model": "gpt-unknown"}, "model"),
]


def test_malformed_bodies_are_400s_and_leave_nothing(server):
    assert len(MALFORMED) >= 20
    for body, param in MALFORMED:
        if isinstance(body, str):
            r = httpx.post(server.url + "/v1/responses", content=body, headers={"x-api-key": "key-a"}, timeout=60)
        else:
            r = server.post("/v1/responses", {"model": MODEL, **body}, headers={"x-api-key": "key-a"})
        assert r.status_code == (404 if param == "model" else 400), (body, r.text)
        error = r.json()["error"]
        assert error["type"] in ("invalid_request_error", "not_found_error") and error["message"]
        if param is not None:
            assert error["param"] is not None and error["param"].startswith(param), (param, error)
    assert_no_request_left(server)


# ---- the store -----------------------------------------------------------------------------------


def _entry(n: int) -> StoredResponse:
    return StoredResponse(json.dumps({"output": ["x" * n]}), "[]")


def test_store_bounds_entries_bytes_and_age(tmp_path):
    store = ResponseStore(limits=StoreLimits(max_entries=3, max_bytes=10_000, ttl_s=3600))
    for i in range(5):
        store.put("k", f"r{i}", _entry(10))
    assert [store.get("k", f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    big = ResponseStore(limits=StoreLimits(max_entries=100, max_bytes=3_000, ttl_s=3600))
    for i in range(5):
        big.put("k", f"r{i}", _entry(900))
    count, size = big.stats()
    assert size <= 3_000 and count == 3 and big.get("k", "r4") is not None and big.get("k", "r0") is None
    with pytest.raises(ValueError, match="store"):
        big.put("k", "huge", _entry(5_000))
    old = ResponseStore(limits=StoreLimits(ttl_s=0.05))
    old.put("k", "r", _entry(1))
    time.sleep(0.1)
    assert old.get("k", "r") is None and old.stats() == (0, 0)


def test_store_on_disk_survives_a_restart_and_keeps_keys_apart(tmp_path):
    path = str(tmp_path / "responses.sqlite")
    store = ResponseStore(path)
    store.put("alice", "resp_1", _entry(3))
    store.close()
    again = ResponseStore(path)
    assert again.get("alice", "resp_1") == _entry(3)
    assert again.get("bob", "resp_1") is None and not again.delete("bob", "resp_1")
    assert again.delete("alice", "resp_1") and again.get("alice", "resp_1") is None


def test_served_store_on_disk_survives_a_server_restart(tmp_path_factory, tmp_path):
    path = str(tmp_path / "store.sqlite")
    with serve_default_model(tmp_path_factory, responses_store_path=path) as s:
        made = s.client().responses.create(model=MODEL, input="Say hello", max_output_tokens=3, temperature=0)
    with serve_default_model(tmp_path_factory, responses_store_path=path) as s:
        assert s.client().responses.retrieve(made.id).output_text == made.output_text


def test_a_response_larger_than_the_store_is_answered_but_not_kept(tmp_path_factory):
    with serve_default_model(tmp_path_factory, responses_store_limits=StoreLimits(max_bytes=200)) as s:
        made = s.client().responses.create(model=MODEL, input="Say hello", max_output_tokens=3, temperature=0)
        assert made.status == "incomplete" and made.output_text
        with pytest.raises(openai.NotFoundError):
            s.client().responses.retrieve(made.id)


# ---- items and the event writer on scripted answers ----------------------------------------------


def test_items_map_onto_chat_turns():
    items = InputItems.model_validate(
        [
            {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        ]
    ).root
    assert chat_messages(items, "Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {}}},
            ],
            "reasoning_content": "hmm",
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "assistant", "content": "done"},
    ]


class _ScriptedRun:
    request_id = "resp_test"

    def __init__(self, events: list[ChoiceEvent]) -> None:
        self._events = events
        self.gen = type("Gen", (), {"final": [type("Out", (), {"num_cached_tokens": 0})()]})()

    async def events(self):
        for e in self._events:
            yield e

    def usage(self):
        from ember.server.protocol import UsageInfo

        return UsageInfo(prompt_tokens=5, completion_tokens=6, total_tokens=11)


def test_reasoning_message_and_calls_stream_as_items():
    events = [
        ChoiceEvent(0, AnswerDelta(reasoning="Think"), [1], None),
        ChoiceEvent(0, AnswerDelta(reasoning="ing.", content="Hi"), [2], None),
        ChoiceEvent(0, AnswerDelta(tool_calls=[ToolCallDelta(0, id="call_1", name="f", arguments="")]), [3], None),
        ChoiceEvent(0, AnswerDelta(tool_calls=[ToolCallDelta(0, arguments="{}")]), [4], None),
        ChoiceEvent(0, AnswerDelta(), [], None, finish_reason="tool_calls"),
    ]
    body = ResponsesRequest.model_validate({"input": "hi", "store": False})
    obj = ResponseObject(model=MODEL)
    state = type("State", (), {"response_store": None})()
    made = _Response(state, "", body, _ScriptedRun(events), obj, "[]")  # type: ignore[arg-type]

    async def collect():
        return [e.model_dump() async for e in made.events()]

    out = asyncio.run(collect())
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    kinds = [(e["type"], e.get("output_index")) for e in out]
    assert kinds == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.completed", None),
    ]
    final = out[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert final["output"][2]["arguments"] == "{}" and final["status"] == "completed"
    assert out[2]["item"]["content"] == [] and out[2]["item"]["status"] == "in_progress"


def test_ignore_eos_reaches_the_sampling_params():
    """vLLM's extension, as on the chat endpoint: `ember bench serve` sends it so every API generates alike."""
    body = {"input": "hi", "max_output_tokens": 5}
    assert not ResponsesRequest.model_validate(body).to_sampling_params(SamplingParams()).ignore_eos
    assert ResponsesRequest.model_validate({**body, "ignore_eos": True}).to_sampling_params(SamplingParams()).ignore_eos
