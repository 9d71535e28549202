"""The OpenAI-compatible server, through the official `openai` client and raw HTTP, against a real uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from conftest import DEVICE

from ember import AsyncLLM, EngineArgs
from ember.server.app import build_app
from ember.server.args import ServerSettings, add_serve_parser, resolve_args, settings_from_args

MODEL = "tiny"


class ServerThread:
    """A real uvicorn on a free port in a background thread; the engine is the app's (shut down on exit)."""

    def __init__(self, engine: AsyncLLM | None, **settings) -> None:
        self.app = build_app(ServerSettings(**{"model_name": MODEL, "model_root": "tiny-dir", **settings}), engine)
        self.state = self.app.state.ember
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app, log_config=None, log_level="warning", access_log=False, timeout_graceful_shutdown=2
            )
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs
        )

    def post(self, path: str, body=None, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60, **kwargs)


def tiny_engine(path, **kwargs) -> AsyncLLM:
    max_waiting = kwargs.pop("max_waiting_requests", None)
    args = EngineArgs(model=str(path), kv_cache_memory=0.02, device=DEVICE, dtype="float32", **kwargs)
    return AsyncLLM(args, max_waiting_requests=max_waiting, served_model_name=MODEL)


@pytest.fixture(scope="module")
def server(llama_dir):
    with ServerThread(tiny_engine(llama_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


# ---- endpoints through the openai client ----------------------------------------------------


def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = models[0].model_dump()
    assert card["object"] == "model" and card["owned_by"] == "ember" and card["max_model_len"] == 1024
    assert isinstance(card["created"], int)
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion_and_stream_agree(server, client):
    full = client.completions.create(model=MODEL, prompt="The quick brown fox", **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    prompt_len = server.post("/tokenize", {"prompt": "The quick brown fox"}).json()["count"]
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt_len, 8)
    assert full.usage.total_tokens == prompt_len + 8

    chunks = list(
        client.completions.create(
            model=MODEL, prompt="The quick brown fox", stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_list_prompts_with_n_keep_openai_index_order(client):
    prompts = ["The quick brown fox", "Paris is the capital"]
    singles = [client.completions.create(model=MODEL, prompt=p, **GREEDY).choices[0].text for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert batch.usage.completion_tokens == 4 * 8

    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, n=2, stream=True, **GREEDY):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: singles[0], 1: singles[0], 2: singles[1], 3: singles[1]}


def test_token_id_prompts_and_echo(server, client):
    ids = server.post("/tokenize", {"prompt": "Large language models"}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt="Large language models", **GREEDY).choices[0].text
    assert client.completions.create(model=MODEL, prompt=ids, **GREEDY).choices[0].text == by_text
    both = client.completions.create(model=MODEL, prompt=[ids, ids], **GREEDY)
    assert [c.text for c in both.choices] == [by_text, by_text]

    echoed = client.completions.create(model=MODEL, prompt="Large language models", echo=True, **GREEDY)
    assert echoed.choices[0].text == "Large language models" + by_text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="Large language models", echo=True, stream=True, **GREEDY
        )
    )
    assert streamed == "Large language models" + by_text


def test_stream_events_stay_one_line_for_clients_that_split_on_unicode_line_breaks(server):
    """JSON leaves U+2028, U+2029 and NEL raw inside strings, and httpx's `aiter_lines` (str.splitlines)
    cuts an event there: the soak lost a request to a token holding one. The server escapes them."""
    prompt = "Lines\u2028and\u2029paragraphs\x85end"
    body = {"model": MODEL, "prompt": prompt, "echo": True, "stream": True, "max_tokens": 2}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks).startswith(prompt)


def test_echo_with_logprobs_covers_the_prompt(server, client):
    ids = server.post("/tokenize", {"prompt": "Large language models"}).json()["tokens"]
    plain = client.completions.create(model=MODEL, prompt=ids, logprobs=2, **GREEDY).choices[0]
    for stream in (False, True):
        if stream:
            chunks = list(
                client.completions.create(model=MODEL, prompt=ids, logprobs=2, echo=True, stream=True, **GREEDY)
            )
            lp = chunks[0].choices[0].logprobs
            for c in chunks[1:]:
                if c.choices and c.choices[0].logprobs:
                    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        getattr(lp, name).extend(getattr(c.choices[0].logprobs, name))
        else:
            lp = client.completions.create(model=MODEL, prompt=ids, logprobs=2, echo=True, **GREEDY).choices[0].logprobs
        n = len(ids)
        assert len(lp.tokens) == n + len(plain.logprobs.tokens)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
        assert lp.token_logprobs[n:] == plain.logprobs.token_logprobs
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="def add(a, b):", logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for _token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4  # texts of byte tokens may coincide
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(model=MODEL, prompt="def add(a, b):", logprobs=3, stream=True, **GREEDY)
    ]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [t for s in streamed for t in s.text_offset] == lp.text_offset


def test_chat_multi_turn_and_stream(server, client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": [{"type": "text", "text": "How "}, {"type": "text", "text": "are you?"}]},
    ]
    full = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    templated = server.post("/tokenize", {"messages": messages}).json()
    assert full.usage.prompt_tokens == templated["count"] and full.usage.completion_tokens == 8

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()

    longer = client.chat.completions.create(
        model=MODEL, max_completion_tokens=3, messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert longer.usage.completion_tokens == 3


def test_chat_logprobs(client):
    messages = [{"role": "user", "content": "Paris is the capital of"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert len(entry.top_logprobs) == 2
        if "\ufffd" not in entry.token:  # pieces of a multi-byte character carry their raw bytes
            assert entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)

    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, logprobs=True, top_logprobs=2, stream=True, **GREEDY
    )
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]

    plain = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_tokenize_detokenize_round_trip(server):
    text = "Paris is the capital of France."
    tok = server.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 1024
    assert server.post("/detokenize", {"tokens": tok["tokens"]}).json() == {"prompt": text}
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": text}]}).json()
    detok = server.post("/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert detok == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_metrics_rise_with_traffic(server, client):
    client.completions.create(model=MODEL, prompt="warm up", **GREEDY)
    before = httpx.get(server.url + "/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    for name in (
        "ember:num_requests_running",
        "ember:kv_cache_usage_perc",
        "ember:generation_tokens_total",
        "ember:prompt_tokens_total",
        "ember:time_to_first_token_seconds_bucket",
        "ember:request_success_total",
    ):
        assert name in before.text
    client.completions.create(model=MODEL, prompt="The quick brown fox", **GREEDY)
    after = httpx.get(server.url + "/metrics").text
    for name in (
        "ember:generation_tokens_total",
        "ember:prompt_tokens_total",
        "ember:request_success_total",
        "ember:e2e_request_latency_seconds_count",
    ):
        assert _metric(after, name) > _metric(before.text, name), name
    assert _metric(after, "ember:generation_tokens_total") - _metric(before.text, "ember:generation_tokens_total") == 8


# ---- logit_bias, allowed_token_ids, bad_words, min_tokens -------------------------------------

EOS = 2  # the tiny checkpoint's eos_token_id


def _token_id(server, text: str) -> int:
    tokens = server.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(tokens) == 1, tokens
    return tokens[0]


def _answer(client, endpoint: str, **kwargs) -> tuple[str, str, int]:
    """Text, finish_reason and completion tokens of one greedy choice, from completions or chat."""
    kwargs = {"model": MODEL, "temperature": 0, "max_tokens": 8, **kwargs}
    if endpoint == "completions":
        r = client.completions.create(prompt="The quick brown fox", **kwargs)
        text = r.choices[0].text
    else:
        r = client.chat.completions.create(messages=[{"role": "user", "content": "The quick brown fox"}], **kwargs)
        text = r.choices[0].message.content
    return text, r.choices[0].finish_reason, r.usage.completion_tokens


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_logit_bias_allowed_token_ids_and_bad_words(server, client, endpoint):
    """OpenAI's logit_bias (string keys, through the official client) and vLLM's allowed_token_ids and
    bad_words reach the sampler from both endpoints: "x" forced, then "xx" (two tokens) banned."""
    x, y = _token_id(server, "x"), _token_id(server, "y")
    assert server.post("/tokenize", {"prompt": "xx", "add_special_tokens": False}).json()["tokens"] == [x, x]
    ignore_eos = {"ignore_eos": True}
    assert _answer(client, endpoint, logit_bias={str(x): 100}, extra_body=ignore_eos)[0] == "x" * 8
    only_xy = {"allowed_token_ids": [x, y], **ignore_eos}
    sampled = _answer(client, endpoint, temperature=1.0, seed=5, extra_body=only_xy)[0]
    assert len(sampled) == 8 and set(sampled) <= {"x", "y"}
    biased = {"logit_bias": {str(x): 100}, "extra_body": {**only_xy, "bad_words": ["xx"]}}
    assert _answer(client, endpoint, **biased)[0] == "xy" * 4  # an x never follows an x
    biased["extra_body"]["bad_words"] = ["x"]
    assert _answer(client, endpoint, **biased)[0] == "y" * 8


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_min_tokens_holds_eos_back(client, endpoint):
    eos_first = {"logit_bias": {str(EOS): 100}}  # EOS would be every greedy token
    assert _answer(client, endpoint, **eos_first) == ("", "stop", 1)
    text, finish, tokens = _answer(client, endpoint, **eos_first, extra_body={"min_tokens": 3})
    assert finish == "stop" and tokens == 4 and text  # three tokens, then EOS


# ---- errors in OpenAI's shape -----------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

ERRORS = [
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "temperature": -0.5}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "n": 0}, "n"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "stop": 5}, "stop"),
    (COMPLETIONS, {"prompt": 5}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": [1, 99999]}, "prompt"),
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content",
    ),
    (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": USER, "presence_penalty": 3}, "presence_penalty"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 1, "512": 1}}, "logit_bias"),  # past the vocabulary
    (CHAT, {"messages": USER, "logit_bias": {"-3": 1}}, "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": {"5": "big"}}, "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": [5]}, "logit_bias"),
    (CHAT, {"messages": USER, "allowed_token_ids": []}, "allowed_token_ids"),
    (COMPLETIONS, {"prompt": "hi", "allowed_token_ids": [3, 512]}, "allowed_token_ids"),
    (CHAT, {"messages": USER, "allowed_token_ids": [3, 512]}, "allowed_token_ids"),
    (COMPLETIONS, {"prompt": "hi", "allowed_token_ids": [-1]}, "allowed_token_ids[0]"),
    (CHAT, {"messages": USER, "bad_words": [" "]}, "bad_words"),
    (COMPLETIONS, {"prompt": "hi", "bad_words": "word"}, "bad_words"),
    (COMPLETIONS, {"prompt": "hi", "bad_words": [5]}, "bad_words[0]"),
    ("/detokenize", {"tokens": [1, -5]}, "tokens[1]"),
    ("/tokenize", {}, "prompt"),
]


@pytest.mark.parametrize("path,body,param", ERRORS, ids=[f"{p}-{json.dumps(b)[:60]}" for p, b, _ in ERRORS])
def test_invalid_values_are_400_naming_the_param(server, path, body, param):
    r = server.post(path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_context_window_error_gives_the_numbers(server):
    r = server.post(COMPLETIONS, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1030})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert all(n in error["message"] for n in ("1024", "1033", "3", "1030"))
    r = server.post(CHAT, {"model": MODEL, "messages": USER, "max_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=USER)


@pytest.mark.parametrize(
    "content", [b'{"prompt": "hi",', b'{"prompt": "\xff\xfe"}', b'{"prompt": "\\ud800 hi"}', b"", b"[1, 2]"]
)
def test_malformed_bodies_are_400(server, content):
    r = httpx.post(server.url + COMPLETIONS, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_body_without_json_content_type_is_still_parsed(server):
    r = httpx.post(
        server.url + COMPLETIONS,
        content=json.dumps({"prompt": "hi", "max_tokens": 2}),
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_unknown_model_route_method_and_size(server):
    r = server.post(COMPLETIONS, {"model": "gpt-4", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"] | {"message": ""} == {
        "message": "",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + COMPLETIONS)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    big = {"model": MODEL, "prompt": "x" * (1 << 20)}
    r = server.post(COMPLETIONS, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit must hold while reading
        yield json.dumps(big).encode()

    r = httpx.post(server.url + COMPLETIONS, content=chunked())
    assert r.status_code == 413


def test_api_key(llama_dir):
    with ServerThread(tiny_engine(llama_dir), api_keys=("s3cret",)) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = s.post(COMPLETIONS, {"prompt": "hi"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert s.post("/tokenize", {"prompt": "hi"}).status_code == 401
        for open_path in ("/health", "/version", "/metrics"):
            assert httpx.get(s.url + open_path).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        out = s.client(api_key="s3cret").completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert out.usage.completion_tokens <= 2


def test_503_until_the_engine_is_attached(llama_dir):
    with ServerThread(None) as s:
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        r = s.post(COMPLETIONS, {"prompt": "hi"})
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
        s.state.engine = tiny_engine(llama_dir)
        assert httpx.get(s.url + "/health").status_code == 200
        assert s.post(COMPLETIONS, {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_chat_answers_paris_with_the_default_model():
    engine = AsyncLLM(EngineArgs(kv_cache_memory=0.1, max_model_len=2048, device=DEVICE, dtype="float32"))
    with ServerThread(engine, model_name="smollm2") as s:
        out = s.client().chat.completions.create(
            model="smollm2",
            temperature=0,
            max_tokens=24,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
    assert "Paris" in out.choices[0].message.content


# ---- the command line and --config ------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ember")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return resolve_args(parser.parse_args(["serve", *argv]))


def test_serve_flags_and_defaults(monkeypatch):
    monkeypatch.delenv("EMBER_API_KEY", raising=False)
    ns = _parse([])
    args, settings = settings_from_args(ns)
    assert (ns.host, ns.port, ns.shutdown_timeout, ns.log_requests) == ("127.0.0.1", 8000, 30.0, False)
    assert args.model is None and settings.model_name == "smollm2-135m-instruct" and settings.api_keys == ()
    assert settings.max_body_bytes == 1 << 20

    args, settings = settings_from_args(_parse(["some/dir", "--max-model-len", "512", "--no-enable-prefix-caching"]))
    assert (args.model, args.max_model_len, args.enable_prefix_caching) == ("some/dir", 512, False)
    assert settings.model_name == "some/dir"
    args, settings = settings_from_args(_parse(["--model", "other", "--served-model-name", "m"]))
    assert (args.model, settings.model_name, settings.model_root) == ("other", "m", "other")

    monkeypatch.setenv("EMBER_API_KEY", "from-env")
    assert settings_from_args(_parse([]))[1].api_keys == ("from-env",)
    assert settings_from_args(_parse(["--api-key", "flag"]))[1].api_keys == ("flag",)


def test_config_yaml_under_the_command_line(tmp_path):
    cfg = tmp_path / "ember.yaml"
    cfg.write_text(
        "model: from/yaml\nport: 9000\nmax-model-len: 512\nenable_prefix_caching: false\n"
        "served_model_name: yaml-name\nlog-requests: true\nshutdown_timeout: 5\n"
    )
    ns = _parse(["--config", str(cfg)])
    args, settings = settings_from_args(ns)
    assert (ns.port, args.max_model_len, args.enable_prefix_caching, args.model) == (9000, 512, False, "from/yaml")
    assert (settings.model_name, settings.log_requests, settings.shutdown_timeout) == ("yaml-name", True, 5.0)

    # Typed flags win, even when they spell out the default value.
    ns = _parse(["cli/model", "--port", "8000", "--config", str(cfg), "--enable-prefix-caching"])
    args, settings = settings_from_args(ns)
    assert (ns.port, args.enable_prefix_caching, args.model, args.max_model_len) == (8000, True, "cli/model", 512)
    assert settings_from_args(_parse(["--config", str(cfg), "--model", "flag/model"]))[0].model == "flag/model"


@pytest.mark.parametrize(
    "text,needle",
    [
        ("nope: 1\n", "nope"),
        ("port: eighty\n", "port"),
        ("enforce-eager: maybe\n", "enforce-eager"),
        ("- a\n", "mapping"),
    ],
)
def test_bad_config_is_one_clear_error(tmp_path, text, needle):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ValueError, match=needle):
        _parse(["--config", str(cfg)])


def test_serve_module_reports_bad_model_in_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "ember.server.launch", str(tmp_path / "missing"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error:"), r.stderr
    assert "Traceback" not in r.stderr


def test_asyncio_not_blocked_by_generation(server):
    """Health answers quickly while a long generation runs: the engine never holds the event loop."""

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            long = asyncio.create_task(
                http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 600, "ignore_eos": True})
            )
            await asyncio.sleep(0.1)
            start = time.monotonic()
            assert (await http.get("/health")).status_code == 200
            latency = time.monotonic() - start
            assert (await long).status_code == 200
            return latency

    assert asyncio.run(main()) < 0.5


def test_stream_without_tokenizer_sends_a_chunk_per_token(tmp_path, llama_dir):
    """A model served without a tokenizer (config.json alone, random weights) has no text to stream;
    as in vLLM, new tokens still get chunks, so TTFT and ITL stay measurable. (A chunk covers every
    token since the client's last read: the tiny model's steps can outrun the stream.)"""
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    with ServerThread(tiny_engine(tmp_path, load_format="dummy")) as s:
        with httpx.stream(
            "POST",
            s.url + "/v1/completions",
            timeout=60,
            json={
                "prompt": [5, 6, 7],
                "max_tokens": 64,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert 1 < len(choices) <= 64 and all(c["text"] == "" for c in choices)
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert events[-1]["usage"]["completion_tokens"] == 64
