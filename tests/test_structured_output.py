"""Structured output through llguidance: JSON schemas, json_object, regex, choice and grammars, on the
server (official `openai` client, default model) and in the library; errors name the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from conftest import DEVICE
from schemas import SCHEMAS
from test_server import MODEL, ServerThread

from ember import AsyncLLM, EngineArgs, SamplingParams
from ember.messages import EngineCoreRequest, decode_input, encode
from ember.sampling.structured import StructuredOutputsParams, check_grammar

MAX_TOKENS = 96


@pytest.fixture(scope="module")
def server():
    # The core in a thread: the grammar path is the same, and the wire form is checked on its own below.
    # Async scheduling on, as on a GPU: constrained requests must make the core step one at a time.
    args = EngineArgs(
        kv_cache_memory=0.25,
        max_model_len=2048,
        device=DEVICE,
        dtype="float32",
        engine_process=False,
        async_scheduling=True,
    )
    with ServerThread(AsyncLLM(args, served_model_name=MODEL)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=120)


def _messages(schema: dict) -> list[dict]:
    return [{"role": "user", "content": f"Reply with JSON matching this schema: {json.dumps(schema)}"}]


def _schema_format(i: int, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}


def _chat(client, schema_index: int, stream: bool) -> tuple[str, str]:
    schema = SCHEMAS[schema_index]
    kwargs = dict(
        model=MODEL,
        messages=_messages(schema),
        temperature=0,
        max_tokens=MAX_TOKENS,
        response_format=_schema_format(schema_index, schema),
    )
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_json_schemas_validate(client, stream):
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(lambda i: _chat(client, i, stream), range(len(SCHEMAS))))
    cut = [i for i, (_, finish) in enumerate(results) if finish == "length"]
    assert len(cut) <= 2, f"schemas {cut} ran out of max_tokens={MAX_TOKENS}"
    for i, (text, finish) in enumerate(results):
        if finish == "length":
            continue
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i])


def test_json_object_on_completions(client):
    out = client.completions.create(
        model=MODEL,
        prompt="A JSON object describing a cat:",
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].text), dict)


def test_regex_and_choice_hold(client):
    pattern = r"[A-Z][a-z]{2,5} [0-9]{1,3}"
    prompts = ["Name and number:", "The winner is", "Code: ", "Write anything"]
    outs = client.completions.create(
        model=MODEL,
        prompt=prompts,
        temperature=0.8,
        seed=1,
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert len(outs.choices) == len(prompts)
    for c in outs.choices:
        assert re.fullmatch(pattern, c.text), c.text
    choices = ["positive", "negative", "neutral"]
    for stream in (False, True):
        kwargs = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}],
            n=3,
            temperature=1.0,
            seed=3,
            max_tokens=10,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        if stream:
            texts = {}
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            texts = list(texts.values())
        else:
            texts = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
        assert len(texts) == 3 and all(t in choices for t in texts), texts


def test_lark_grammar(client):
    grammar = 'start: "(" num " " op " " num ")"\nop: "+" | "-"\nnum: /[1-9][0-9]?/'
    out = client.completions.create(
        model=MODEL,
        prompt="An arithmetic expression:",
        temperature=0,
        max_tokens=20,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert re.fullmatch(r"\([1-9][0-9]? [+-] [1-9][0-9]?\)", out.choices[0].text), out.choices[0].text


def test_mixed_batch_leaves_free_requests_alone(client):
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    greedy = dict(model=MODEL, temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **greedy).choices[0].text for p in prompts]

    def run(job):
        kind, i = job
        if kind == "free":
            return client.completions.create(prompt=prompts[i], **greedy).choices[0].text
        return _chat(client, i, stream=False)[0]

    jobs = [("json", 0), ("free", 0), ("json", 5), ("free", 1), ("json", 13), ("free", 2)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    assert [r for (kind, _), r in zip(jobs, results) if kind == "free"] == alone


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(server, body, param):
    for path, base in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        r = server.post(path, {"model": MODEL, "max_tokens": 4, **base, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["message"].startswith(param), error


def test_constraint_crosses_the_wire():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMAS[13]))
    msg = EngineCoreRequest("r", [1, 2], params, 8, [2], 0.0)
    assert decode_input(encode(msg)).sampling_params.structured_outputs == params.structured_outputs


def test_library_structured_outputs(default_llm):
    """The library path: SamplingParams(structured_outputs=...) with LLM, and ValueErrors naming the
    field for bad grammars before anything reaches the core."""
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: "):
        check_grammar(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}}))
    with pytest.raises(ValueError, match=r"(?s)^structured_outputs\.regex: .*unclosed"):
        check_grammar(StructuredOutputsParams(regex="[a-"))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})
    with pytest.raises(ValueError, match=r"^structured_outputs\.grammar: "):
        default_llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: ???")))
    schemas = [SCHEMAS[6], SCHEMAS[11], SCHEMAS[19]]
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=s))
        for s in schemas
    ]
    params.append(
        SamplingParams(
            temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])
        )
    )
    outs = default_llm.generate(
        ["A user as JSON:", "A ticket as JSON:", "A task as JSON:", "Pick one:"], params, use_tqdm=False
    )
    for out, schema in zip(outs, schemas):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert outs[3].outputs[0].text in ("alpha", "beta")


def test_dead_end_fails_the_request_not_the_engine(server, client):
    """min_tokens holds EOS back after a complete choice, so no token can follow: the request ends with
    an error naming structured output (the request's own constraint: a 400, short, without the grammar),
    and the engine goes on serving."""
    r = server.post(
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "Pick:",
            "max_tokens": 8,
            "min_tokens": 4,
            "structured_outputs": {"choice": ["yes", "no"]},
        },
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs" and error["message"].startswith("structured output failed")
    assert "<grammar>" not in error["message"] and len(error["message"]) < 200
    out = client.completions.create(
        model=MODEL, prompt="Pick:", max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert out.choices[0].text in ("yes", "no")
