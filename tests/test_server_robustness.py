"""The server under stress: vanishing clients, a full queue, a failing request, SIGTERM mid-stream."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from urllib.parse import urlparse

import httpx
import pytest
from conftest import free_port, make_checkpoint, wait_healthy
from test_server import ServerThread, tiny_engine

from ember.core.request import Request

LONG = {"prompt": [5, 17, 99, 203, 40], "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def long_ctx_dir(tmp_path_factory):
    """The tiny model with room for generations of several seconds."""
    return make_checkpoint(tmp_path_factory.mktemp("long") / "llama", "llama", max_position_embeddings=8192)


@pytest.fixture(scope="module")
def server(long_ctx_dir):
    with ServerThread(tiny_engine(long_ctx_dir)) as s:
        yield s


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """Send a request and leave the connection open, so the test decides when the client vanishes."""
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port))
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def all_blocks_free(engine) -> bool:
    """From the core's stats, which it sends after every step and after aborts when idle."""
    stats = engine.scheduler_stats
    return stats is not None and stats.kv_cache_usage == 0 and stats.num_running == stats.num_waiting == 0


@pytest.mark.parametrize(
    "path,extra",
    [
        ("/v1/completions", {"stream": True}),
        ("/v1/completions", {}),
        ("/v1/chat/completions", {"stream": True}),
        ("/v1/chat/completions", {}),
    ],
)
def test_client_disconnect_aborts_and_frees_all_blocks(server, path, extra):
    engine = server.state.engine
    body = {**LONG, "max_tokens": 7000, **extra}
    if "chat" in path:
        body = {**body, "messages": [{"role": "user", "content": "Tell me a long story"}]}
        del body["prompt"]
    sock = raw_post(server.url, path, body)
    wait_until(lambda: engine.scheduler_stats is not None and engine.scheduler_stats.num_running == 1)
    if extra.get("stream"):  # wait for the headers and the first chunks
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
    time.sleep(0.2)
    assert engine.scheduler_stats.kv_cache_usage > 0
    sock.close()
    wait_until(lambda: all_blocks_free(engine), timeout=5)
    # The server keeps serving.
    assert server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_full_queue_is_429_with_retry_after(long_ctx_dir):
    with ServerThread(tiny_engine(long_ctx_dir, max_num_seqs=1, max_waiting_requests=1)) as s:
        engine = s.state.engine
        running = raw_post(s.url, "/v1/completions", {**LONG, "max_tokens": 7000, "stream": True})
        wait_until(lambda: engine.scheduler_stats is not None and engine.scheduler_stats.num_running == 1)
        waiting = raw_post(s.url, "/v1/completions", {**LONG, "max_tokens": 7000})
        wait_until(lambda: engine.num_waiting == 1)
        r = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        running.close()
        waiting.close()
        wait_until(lambda: all_blocks_free(engine), timeout=5)
        assert s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


@pytest.fixture(scope="module")
def inproc_server(long_ctx_dir):
    """The engine core in this process (a thread), so that a test can inject a failure into it."""
    with ServerThread(tiny_engine(long_ctx_dir, engine_process=False)) as s:
        yield s


def test_request_failing_inside_the_engine_is_500_and_others_carry_on(inproc_server, monkeypatch):
    server = inproc_server
    doomed = [7, 7, 7, 7]
    original = Request.check_stop

    def check_stop(request, token_id, max_model_len):
        if request.prompt_token_ids == doomed and request.num_output_tokens >= 3:
            raise RuntimeError("injected failure")
        return original(request, token_id, max_model_len)

    monkeypatch.setattr(Request, "check_stop", check_stop)
    results = {}
    good = threading.Thread(
        target=lambda: results.update(good=server.post("/v1/completions", {**LONG, "max_tokens": 400}))
    )
    good.start()
    wait_until(
        lambda: server.state.engine.scheduler_stats is not None and server.state.engine.scheduler_stats.num_running == 1
    )
    bad = server.post("/v1/completions", {"prompt": doomed, "max_tokens": 50, "ignore_eos": True})
    good.join(60)
    assert bad.status_code == 500, bad.text
    error = bad.json()["error"]
    assert error["type"] == "internal_server_error" and "injected failure" in error["message"]
    assert results["good"].status_code == 200 and results["good"].json()["usage"]["completion_tokens"] == 400

    # Streaming: a failure after the stream started arrives as an error event, then the stream ends
    # properly; one that reaches the server together with the first tokens (a fast engine's steps
    # coalesce) is still answered before any byte was sent, so as a 500 error.
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=60,
        json={"prompt": doomed, "max_tokens": 50, "ignore_eos": True, "stream": True},
    ) as r:
        assert r.status_code in (200, 500)
        if r.status_code == 500:
            r.read()
            assert "injected failure" in r.json()["error"]["message"]
        else:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and "injected failure" in json.loads(events[-2])["error"]["message"]
    assert server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert all_blocks_free(server.state.engine)


# ---- SIGTERM to `ember serve` ---------------------------------------------------------------


def _start_serve(model_dir, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "EMBER_LOGGING_LEVEL": "INFO"}
    env.pop("EMBER_API_KEY", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ember.server.launch",
            str(model_dir),
            "--port",
            str(port),
            "--kv-cache-memory",
            "0.05",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url)
    return proc, url


def _stream_in_thread(url: str, body: dict) -> tuple[threading.Thread, list[str], threading.Event]:
    events: list[str] = []
    first = threading.Event()

    def run() -> None:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
        first.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, events, first


def test_sigterm_lets_the_running_stream_finish_then_exits_0(long_ctx_dir):
    proc, url = _start_serve(long_ctx_dir, "--shutdown-timeout", "30")
    try:
        thread, events, first = _stream_in_thread(url, {**LONG, "max_tokens": 3000})
        assert first.wait(30)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(url + "/health").status_code == 503, timeout=5)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["type"] == "service_unavailable"
        assert thread.is_alive(), "the stream should still be running while the server drains"
        thread.join(60)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
        assert proc.wait(30) == 0
        assert time.monotonic() - sent < 30
    finally:
        proc.kill()
    out, err = proc.communicate()
    assert "Traceback" not in err, err
    assert sum("serving" in line for line in err.splitlines()) == 1


def test_sigterm_past_the_grace_period_ends_streams_cleanly(long_ctx_dir):
    proc, url = _start_serve(long_ctx_dir, "--shutdown-timeout", "0.5")
    try:
        thread, events, first = _stream_in_thread(url, {**LONG, "max_tokens": 8000})
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        thread.join(30)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable" and "shut down" in error["message"]
        assert proc.wait(15) == 0
    finally:
        proc.kill()
    assert "Traceback" not in proc.communicate()[1]
