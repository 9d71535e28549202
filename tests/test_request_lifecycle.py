"""Every bad request is a clean 4xx, and nothing of it stays behind.

For each class of bad request: the answer is an OpenAI-shaped 4xx naming the field, and afterwards the
front end tracks no request, the engine core holds none, no KV block is in use, and an idle server
stops at once on SIGTERM. Each class here gave a 500 once, or a request the front end never forgot
(an integer past 2**64 failed msgpack after the request was registered, and SIGTERM then waited out
its whole drain window).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
from conftest import free_port
from test_server import MODEL, ServerThread, tiny_engine
from test_server_robustness import _start_serve, wait_until

from ember import SamplingParams
from ember.messages import EngineCoreRequest, SchedulerStats
from ember.sampling.structured import StructuredOutputsParams

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
HUGE = 2**70  # past msgpack's 64 bits

# (path, body, status, param): one of each class of bad request a client can send cheaply.
BAD = [
    (COMPLETIONS, {"prompt": "hi", "seed": HUGE}, 400, "seed"),
    (COMPLETIONS, {"prompt": "hi", "seed": -HUGE}, 400, "seed"),
    (COMPLETIONS, {"prompt": "hi", "top_k": HUGE}, 400, "top_k"),
    (COMPLETIONS, {"prompt": "hi", "top_k": 100_000}, 400, "top_k"),  # past the vocabulary (512)
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [HUGE]}, 400, "stop_token_ids[0]"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [2, 512]}, 400, "stop_token_ids"),
    (COMPLETIONS, {"prompt": "hi", "min_tokens": HUGE}, 400, "min_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": HUGE}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": [5, HUGE]}, 400, "prompt"),
    (CHAT, {"messages": USER, "seed": HUGE, "stream": True}, 400, "seed"),
    (CHAT, {"messages": USER, "top_logprobs": HUGE, "logprobs": True}, 400, "top_logprobs"),
    ("/detokenize", {"tokens": [HUGE]}, 400, "tokens[0]"),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    (
        CHAT,
        {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False, "tokenizer": 1}},
        400,
        "chat_template_kwargs",
    ),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"grammar": ""}}, 400, "structured_outputs.grammar"),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"regex": "a{1000000}"}}, 400, "structured_outputs.regex"),
    (COMPLETIONS, {"prompt": [5, 6], "structured_outputs": {"regex": "a{1000000}"}}, 400, "structured_outputs.regex"),
    (
        CHAT,
        {
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}},
            },
        },
        400,
        "response_format.json_schema.schema",
    ),
    (COMPLETIONS, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"600": 1}}, 400, "logit_bias"),  # past the vocabulary (512)
    (CHAT, {"messages": USER, "allowed_token_ids": [600]}, 400, "allowed_token_ids"),
    (CHAT, {"messages": USER, "bad_words": [""], "stream": True}, 400, "bad_words"),
    (COMPLETIONS, {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
        400,
        "messages[0].content",
    ),
    (COMPLETIONS, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    (COMPLETIONS, {"prompt": "x" * (1 << 20)}, 413, None),
]
DEEP = b"[" * 5000 + b"]" * 5000  # 10 KB; Python's JSON parser recursed past its limit on it


def _ids(cases):
    return [f"{path}-{json.dumps(body)[:70]}" for path, body, *_ in cases]


def _check_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


def _body(body: dict) -> dict:
    return body if "model" in body else {"model": MODEL, **body}


def _core_stats(engine) -> SchedulerStats:
    """The core's own state now (a utility call), not the last step's stats."""
    return msgspec.convert(asyncio.run(engine.call_utility("stats")), SchedulerStats)


def _nothing_left(engine) -> None:
    assert engine.num_live_requests == 0
    stats = _core_stats(engine)
    assert stats.num_requests == stats.num_running == stats.num_waiting == 0, stats
    assert stats.kv_cache_usage == 0


@pytest.fixture(scope="module")
def server(llama_dir):
    """The engine core in its own process, as `ember serve` runs it: requests cross msgpack."""
    with ServerThread(tiny_engine(llama_dir, max_model_len=256)) as s:
        yield s


@pytest.mark.parametrize("path,body,status,param", BAD, ids=_ids(BAD))
def test_bad_request_is_4xx_naming_the_field_and_leaves_nothing(server, path, body, status, param):
    r = httpx.post(server.url + path, json=_body(body), timeout=60)
    _check_error(r, status, param)
    _nothing_left(server.state.engine)


def test_deep_json_is_400_before_parsing(server):
    r = httpx.post(server.url + COMPLETIONS, content=DEEP, headers={"content-type": "application/json"})
    _check_error(r, 400, None)
    assert "nests deeper than 100 levels" in r.json()["error"]["message"]
    # as deep as allowed still parses (and is then refused for what it is)
    ok = b'{"prompt": "hi", "x": ' + b"[" * 98 + b"]" * 98 + b', "max_tokens": 1}'
    assert httpx.post(server.url + COMPLETIONS, content=ok).status_code == 200


def test_the_request_ends_once_whatever_fails_after_it_was_accepted(server, monkeypatch):
    """The lifecycle guard: a failure between the front end's tables and the core (here, sending)
    answers the request once and forgets it everywhere."""
    engine = server.state.engine
    send = engine.client.send

    def failing_send(message):
        if isinstance(message, EngineCoreRequest) and message.request_id.endswith("#1"):
            raise OverflowError("injected: cannot serialize")
        send(message)

    monkeypatch.setattr(engine.client, "send", failing_send)
    for stream in (False, True):  # n=2: the first sequence reached the core, the second did not
        r = httpx.post(
            server.url + COMPLETIONS,
            json={"model": MODEL, "prompt": "hi", "n": 2, "max_tokens": 50, "ignore_eos": True, "stream": stream},
            timeout=60,
        )
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
    monkeypatch.setattr(engine.client, "send", send)
    wait_until(lambda: _core_stats(engine).num_requests == 0)
    _nothing_left(engine)
    assert httpx.post(server.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_grammar_failing_inside_the_engine_is_the_requests_400(server, monkeypatch):
    """A constraint that passes the front end's checks but fails mid-answer (a lexer limit hit later)
    is the request's error, not the server's."""
    from ember.frontend.async_llm import AsyncLLM
    from ember.frontend.errors import RequestFailedError

    async def failing(self, *args, **kwargs):
        raise RequestFailedError("structured output failed: lexer error: too many expressions constructed")
        yield

    monkeypatch.setattr(AsyncLLM, "generate", failing)
    r = httpx.post(server.url + COMPLETIONS, json={"prompt": "hi", "structured_outputs": {"regex": "a+"}})
    _check_error(r, 400, "structured_outputs")


def test_library_rejects_the_same_values_naming_the_field(llama_dir):
    for kwargs, field in [
        ({"seed": HUGE}, "seed"),
        ({"top_k": HUGE}, "top_k"),
        ({"stop_token_ids": [HUGE]}, "stop_token_ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": HUGE}, "max_tokens"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}"):
            SamplingParams(**kwargs)
    # the largest seed stays valid for every sequence of n (seed + i wraps within 64 bits)
    assert SamplingParams(seed=2**63 - 1, n=3).seed == 2**63 - 1

    from ember import LLM

    llm = LLM(str(llama_dir), kv_cache_memory=0.02, dtype="float32", engine_process=False, max_model_len=256)
    try:
        for params, field in [
            (SamplingParams(top_k=100_000), "top_k"),
            (SamplingParams(stop_token_ids=[512]), "stop_token_ids"),
            (
                SamplingParams(structured_outputs=StructuredOutputsParams(regex="a{1000000}")),
                "structured_outputs.regex",
            ),
            (SamplingParams(structured_outputs=StructuredOutputsParams(grammar="")), "structured_outputs.grammar"),
        ]:
            with pytest.raises(ValueError, match=f"^{field}"):
                llm.generate("hi", params, use_tqdm=False)
        out = llm.generate("hi", SamplingParams(seed=2**63 - 1, n=3, temperature=1.0, max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs) == 3
        with pytest.raises(ValueError, match="^chat_template_kwargs"):
            llm.get_tokenizer().apply_chat_template(USER, variables={"messages": []})
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.llm_engine.shutdown()


# ---- the whole server process: SIGTERM after bad requests, a taken port ----------------------


def test_idle_sigterm_after_every_bad_request_exits_at_once(llama_dir):
    proc, url = _start_serve(llama_dir, "--max-model-len", "256", "--served-model-name", MODEL)
    try:
        for path, body, status, param in BAD:
            _check_error(httpx.post(url + path, json=_body(body), timeout=60), status, param)
        _check_error(httpx.post(url + COMPLETIONS, content=DEEP), 400, None)
        # a client that leaves mid-stream
        with httpx.stream(
            "POST", url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
        ) as r:
            next(r.iter_lines())
        wait_until(lambda: _gauges(url) == {"running": 0.0, "waiting": 0.0, "kv": 0.0})
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert time.monotonic() - sent < 2.0
    finally:
        proc.kill()
    assert "Traceback" not in proc.communicate()[1]


def _gauges(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    names = {
        "ember:num_requests_running": "running",
        "ember:num_requests_waiting": "waiting",
        "ember:kv_cache_usage_perc": "kv",
    }
    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name in names:
                values[names[sample.name]] = sample.value
    return values


def test_taken_port_fails_at_once_without_starting_the_core(llama_dir):
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "ember.server.launch", str(llama_dir), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        elapsed = time.monotonic() - start
    assert proc.returncode == 2
    assert f"error: cannot listen on 127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr
    assert elapsed < 1.5, elapsed
