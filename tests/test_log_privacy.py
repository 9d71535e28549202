"""Prompts and outputs never reach the logs unless `--log-request-text` is given.

A real `ember serve` (front end and engine core process, both writing to the captured stdout and
stderr) gets requests carrying unique markers: in a prompt, in a stop string, in chat messages, in
requests that fail (a bad role, a prompt too long for the context, an unknown model name, broken
JSON) and in /tokenize. At
each log level, with `--log-requests`, no marker may appear; with `--log-request-text` the prompts,
the output and the error that quotes its input do.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import uuid

import httpx
import pytest
from conftest import free_port, make_checkpoint, wait_healthy

from ember.logger import route_server_logs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("privacy") / "llama", "llama")


def _serve(model_dir, level: str, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "EMBER_LOGGING_LEVEL": level, "PYTHONUNBUFFERED": "1"}
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
            "0.02",
            "--max-model-len",
            "256",
            "--log-requests",
            "--uvicorn-log-level",
            "trace" if level == "DEBUG" else level.lower(),
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, poll=0.1)
    return proc, url


def _requests(url: str) -> tuple[dict[str, str], list[str]]:
    """Send every kind of request; returns the markers (by where they were) and the generated texts."""
    m = {
        k: f"zq{k}{uuid.uuid4().hex[:10]}"
        for k in ("prompt", "stop", "stream", "system", "user", "role", "toolong", "model", "tokenize", "json")
    }
    base = {"temperature": 0, "max_tokens": 6}
    outputs = []

    def post(path: str, body: dict, status: int = 200) -> httpx.Response:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == status, r.text
        return r

    r = post("/v1/completions", {**base, "prompt": f"Tell me about {m['prompt']}", "stop": [m["stop"]]})
    outputs.append(r.json()["choices"][0]["text"])
    with httpx.stream(
        "POST", url + "/v1/completions", json={**base, "prompt": m["stream"], "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        r.read()
    r = post(
        "/v1/chat/completions",
        {**base, "messages": [{"role": "system", "content": m["system"]}, {"role": "user", "content": m["user"]}]},
    )
    outputs.append(r.json()["choices"][0]["message"]["content"])
    post("/v1/chat/completions", {**base, "messages": [{"role": m["role"], "content": "hi"}]}, 400)
    post("/v1/completions", {**base, "prompt": f"{m['toolong']} " * 100, "max_tokens": 200}, 400)
    post("/v1/completions", {**base, "prompt": "hi", "model": m["model"]}, 404)  # the error quotes the name
    post("/tokenize", {"prompt": m["tokenize"]})
    r = httpx.post(
        url + "/v1/completions",
        content=f'{{"prompt": "{m["json"]}',
        timeout=60,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    return m, outputs


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out


@pytest.mark.parametrize("level", ["DEBUG", "INFO", "WARNING"])
def test_no_text_in_logs_without_log_request_text(model_dir, level):
    proc, url = _serve(model_dir, level)
    try:
        markers, _ = _requests(url)
    finally:
        logs = _stop(proc)
    leaked = [where for where, marker in markers.items() if marker in logs]
    assert not leaked, logs
    if level != "WARNING":  # the request lines are there, without the text
        assert logs.count("request cmpl-") == 3 and logs.count("request chatcmpl-") == 1, logs
        assert "rejected (404 not_found_error)" in logs and "stop=<1 items>" in logs, logs


def test_log_request_text_adds_prompts_outputs_and_errors(model_dir):
    proc, url = _serve(model_dir, "INFO", "--log-request-text")
    try:
        markers, outputs = _requests(url)
    finally:
        logs = _stop(proc)
    shown = {where for where, marker in markers.items() if marker in logs}
    # /tokenize is never logged; a JSON parse error and pydantic's bad-role error do not quote the input.
    assert shown == set(markers) - {"tokenize", "json", "role"}, logs
    for text in outputs:  # the log line carries them as JSON
        assert json.dumps(text, ensure_ascii=False) in logs, (text, logs)


def test_exception_messages_are_hidden_from_the_logs():
    """An unexpected exception can quote the request: uvicorn's traceback of it goes through Ember's
    handler without the messages (of the exception and of its cause)."""
    handler = logging.getLogger("ember").handlers[0]
    root = logging.getLogger()
    before = (list(handler.filters), list(root.handlers), root.level)
    buf = io.StringIO()
    stream = handler.setStream(buf)
    route_server_logs(hide_text=True)
    cause, secret = (f"zq{uuid.uuid4().hex}" for _ in range(2))  # not in the source lines the traceback shows
    try:
        try:
            try:
                raise KeyError(cause)
            except KeyError as e:
                raise ValueError(secret) from e
        except ValueError:
            logging.getLogger("uvicorn.error").exception("Exception in ASGI application")
    finally:
        handler.setStream(stream)
        handler.filters[:], root.handlers[:] = before[0], before[1]
        root.setLevel(before[2])
    err = buf.getvalue()
    assert "Exception in ASGI application" in err and "builtins.ValueError: <message hidden" in err, err
    assert "builtins.KeyError" in err and secret not in err and cause not in err, err
