"""A core process that stops answering without dying (SIGSTOP, a deadlock) is found by its heartbeats.

The core process sends an `EngineCoreHeartbeat` (its loop's progress) about once a second once
ready; `MPClient` consumes them. Checked here:

- `HangWatch`, the client's verdict, on fabricated heartbeat streams: silence while the client waits
  past the heartbeat timeout, or one step without progress past the iteration timeout, is a hang;
  a long step that keeps sending heartbeats, or a client that simply did not ask for a while, is not;
- `MPClient` against a fake core process that sends scripted messages: heartbeats never reach the
  caller, none are expected while the core loads, a stuck step is reported once and the core killed;
- `LLM(engine_process=True)` with a real core: an idle engine with short timeouts keeps working,
  a SIGSTOPped core fails the next call with `EngineDeadError` and is killed;
- `ember serve` with the default timeouts: SIGSTOP of the core ends a running stream with an error
  within 5 s (+ slack), then 503s, the server exits 1, and the stopped core is gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import make_checkpoint
from test_engine_process import LONG, Serve, _Stream
from test_tensor_parallel import _alive

from ember import LLM, EngineArgs, SamplingParams
from ember.frontend import core_client
from ember.frontend.core_client import HEARTBEAT_TIMEOUT_ENV, ITERATION_TIMEOUT_ENV, HangWatch, MPClient
from ember.frontend.errors import EngineDeadError
from ember.messages import EngineCoreFailed, EngineCoreHeartbeat, EngineCoreOutputs, SchedulerStats

_STATS = SchedulerStats(0, 0, 0.0, 0, 0, 0, 0)


# ---- 1. the verdict ------------------------------------------------------------------------------


def test_silence_while_waiting_past_the_heartbeat_timeout_is_a_hang():
    watch = HangWatch(heartbeat_timeout=5.0, iteration_timeout=60.0)
    for _ in range(19):
        watch.waited(0.25)
    assert watch.verdict() is None
    watch.heard(EngineCoreHeartbeat(3, 0.0))  # any message restarts the count
    for _ in range(19):
        watch.waited(0.25)
    assert watch.verdict() is None
    watch.waited(0.25)
    assert watch.verdict() == "engine core stopped answering: no heartbeat for 5.0s"


def test_a_step_stuck_past_the_iteration_timeout_is_a_hang_though_heartbeats_come():
    watch = HangWatch(heartbeat_timeout=5.0, iteration_timeout=60.0)
    for second in range(62):  # one heartbeat a second, the loop in iteration 12 all along
        watch.waited(1.0)
        watch.heard(EngineCoreHeartbeat(12, float(second)))
        if second <= 60:
            assert watch.verdict() is None, second
    verdict = watch.verdict()
    assert verdict is not None and verdict.startswith("engine core stopped answering: its loop has been in one step")
    assert "61.0s" in verdict and "iteration 12" in verdict and f"{ITERATION_TIMEOUT_ENV}=60" in verdict


def test_a_long_step_with_heartbeats_within_the_iteration_timeout_is_not_a_hang():
    watch = HangWatch(heartbeat_timeout=5.0, iteration_timeout=60.0)
    for second in range(59):  # a 59 s prefill: far past the heartbeat timeout, heartbeats still come
        watch.waited(1.0)
        watch.heard(EngineCoreHeartbeat(4, float(second)))
        assert watch.verdict() is None
    # Its outputs arrive, then a stale backlog is not held against the next iteration.
    watch.heard(EngineCoreOutputs([], 0.0, _STATS))
    assert watch.step_s == 0.0
    watch.heard(EngineCoreHeartbeat(5, 0.5))
    assert watch.verdict() is None


def test_timeouts_of_zero_turn_the_checks_off():
    watch = HangWatch(heartbeat_timeout=0, iteration_timeout=0)
    watch.waited(1e6)
    watch.heard(EngineCoreHeartbeat(1, 1e6))
    watch.waited(1e6)
    assert watch.verdict() is None
    assert watch.heartbeat_interval == 0  # the core then sends none
    assert HangWatch(0, 60).heartbeat_interval == 1.0  # the iteration check alone still needs them
    assert HangWatch(5, 60).heartbeat_interval == 1.0
    assert HangWatch(0.5, 60).heartbeat_interval == pytest.approx(0.1)


def test_timeouts_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(HEARTBEAT_TIMEOUT_ENV, "2.5")
    monkeypatch.setenv(ITERATION_TIMEOUT_ENV, "7")
    watch = HangWatch.from_env()
    assert (watch.heartbeat_timeout, watch.iteration_timeout) == (2.5, 7.0)
    monkeypatch.delenv(HEARTBEAT_TIMEOUT_ENV)
    monkeypatch.delenv(ITERATION_TIMEOUT_ENV)
    assert (HangWatch.from_env().heartbeat_timeout, HangWatch.from_env().iteration_timeout) == (4.5, 60.0)
    monkeypatch.setenv(HEARTBEAT_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=HEARTBEAT_TIMEOUT_ENV):
        HangWatch.from_env()


# ---- 2. MPClient against a scripted fake core -----------------------------------------------------

# Reads the bootstrap like the real core, then sends what argv[1] says: ["sleep", s], ["ready"],
# ["heartbeat", iteration, step_s], ["outputs"]; then waits for its stdin to close.
_FAKE_CORE = r"""
import json, os, sys, time
import msgspec, zmq
from ember.messages import BOOTSTRAP_LENGTH, CoreBootstrap
from ember.messages import EngineCoreHeartbeat, EngineCoreOutputs, EngineCoreReady, SchedulerStats, encode

def read(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            sys.exit(1)
        data += chunk
    return data

(size,) = BOOTSTRAP_LENGTH.unpack(read(BOOTSTRAP_LENGTH.size))
boot = msgspec.msgpack.decode(read(size), type=CoreBootstrap)
sock = zmq.Context().socket(zmq.PUSH)
sock.connect(boot.output_address)
for kind, *values in json.loads(sys.argv[1]):
    if kind == "sleep":
        time.sleep(values[0])
    elif kind == "ready":
        sock.send(encode(EngineCoreReady(8, 16, 128, 4, 128, 512, "cpu", "float32", "auto", "none", 0, 0,
                                         False, False, 1, "fake")))
    elif kind == "heartbeat":
        sock.send(encode(EngineCoreHeartbeat(*values)))
    elif kind == "outputs":
        sock.send(encode(EngineCoreOutputs([], time.monotonic(), SchedulerStats(0, 0, 0.0, 0, 0, 0, 0))))
while os.read(0, 4096):
    pass
"""


def _fake_client(monkeypatch, script: list, heartbeat_timeout: float, iteration_timeout: float) -> MPClient:
    monkeypatch.setenv(HEARTBEAT_TIMEOUT_ENV, str(heartbeat_timeout))
    monkeypatch.setenv(ITERATION_TIMEOUT_ENV, str(iteration_timeout))
    real_popen = subprocess.Popen

    def popen(args, **kwargs):
        assert args[1:] == ["-m", "ember.core.process"]
        return real_popen([sys.executable, "-c", _FAKE_CORE, json.dumps(script)], **kwargs)

    monkeypatch.setattr(core_client.subprocess, "Popen", popen)
    return MPClient(EngineArgs().engine_config())


def _heartbeats(iteration: int, seconds: float, every: float = 0.1, start: float = 0.0) -> list:
    """A loop inside one iteration for `seconds` (from `start` on), as its heartbeat thread reports it."""
    return [
        x
        for k in range(1, round(seconds / every) + 1)
        for x in (["sleep", every], ["heartbeat", iteration, round(start + k * every, 3)])
    ]


def _collect(client: MPClient, seconds: float) -> list:
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        got += client.get_output(timeout=0.1)
    return got


def test_a_fake_core_stuck_in_one_step_is_reported_once_and_killed(monkeypatch):
    client = _fake_client(monkeypatch, [["ready"], *_heartbeats(7, 5.0)], heartbeat_timeout=5, iteration_timeout=1)
    try:
        ready = client.wait_ready(10)
        assert ready.description == "fake"
        assert client.wait_ready(0.01) is ready  # the handshake is answered again, not waited for
        start = time.monotonic()
        got = client.get_output(timeout=None)  # waits through the heartbeats, which it never returns
        took = time.monotonic() - start
        assert len(got) == 1 and isinstance(got[0], EngineCoreFailed), got
        assert got[0].message.startswith("engine core stopped answering: its loop has been in one step for 1.1s")
        assert "iteration 7" in got[0].message
        assert 0.9 < took < 3.0, took
        assert not client.is_alive and client.failure == got[0].message
        assert client.proc.wait(5) == -signal.SIGKILL
        assert client.get_output(timeout=0.2) == []  # reported once
    finally:
        start = time.monotonic()
        client.shutdown()
        assert time.monotonic() - start < 1.0, "a core killed as hung is not given the polite 10 s"


def test_a_fake_core_in_a_long_step_and_a_client_that_pauses_are_not_hangs(monkeypatch):
    script = [
        ["sleep", 1.0],
        ["ready"],  # loading sends no heartbeats: not held against the core
        *_heartbeats(3, 1.5),  # a 1.5 s step: three heartbeat timeouts long
        ["outputs"],
        *_heartbeats(4, 2.0, start=0.0),
    ]
    client = _fake_client(monkeypatch, script, heartbeat_timeout=0.5, iteration_timeout=2.5)
    try:
        client.wait_ready(10)
        got = _collect(client, 1.0)
        time.sleep(1.0)  # the caller does not ask for output for twice the heartbeat timeout
        got += _collect(client, 1.5)
        assert [type(m) for m in got] == [EngineCoreOutputs], got  # never a heartbeat
        assert client.is_alive and client.proc.poll() is None
        # The script ends: silence now, and the client notices once it waits for half a second.
        start = time.monotonic()
        got = client.get_output(timeout=None)
        assert [type(m) for m in got] == [EngineCoreFailed], got
        assert re.fullmatch(r"engine core stopped answering: no heartbeat for 0\.[56]s", got[0].message), got
        assert time.monotonic() - start < 1.5
        assert client.proc.wait(5) == -signal.SIGKILL
    finally:
        client.shutdown(timeout=0)


# ---- 3. a real core: LLM(engine_process=True) --------------------------------------------------------


def test_llm_with_its_core_stopped_raises_engine_dead_and_the_core_is_killed(llama_dir, monkeypatch):
    monkeypatch.setenv(HEARTBEAT_TIMEOUT_ENV, "0.5")
    monkeypatch.setenv(ITERATION_TIMEOUT_ENV, "30")
    llm = LLM(str(llama_dir), device="cpu", dtype="float32", kv_cache_memory=0.02, engine_process=True)
    client = llm.llm_engine.client
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        assert llm.generate(["hello"], params, use_tqdm=False)[0].finished
        time.sleep(1.5)  # an idle engine between calls: heartbeats pile up unread, nothing fails
        os.kill(client.proc.pid, signal.SIGSTOP)  # a pause shorter than the timeout, while not asked
        time.sleep(0.3)
        os.kill(client.proc.pid, signal.SIGCONT)
        assert llm.generate(["hello again"], params, use_tqdm=False)[0].finished
        assert client.is_alive
        os.kill(client.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(EngineDeadError, match="engine core stopped answering: no heartbeat for"):
            llm.generate(["hello once more"], params, use_tqdm=False)
        assert time.monotonic() - stopped < 2.5
        assert client.proc.wait(5) == -signal.SIGKILL
    finally:
        if client.proc.poll() is None:
            client.proc.kill()
        start = time.monotonic()
        llm.llm_engine.shutdown()
        assert time.monotonic() - start < 2.0


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory) -> Path:
    """A model whose 8000-token prefill takes about a second on CPU."""
    return make_checkpoint(
        tmp_path_factory.mktemp("wide") / "llama",
        "llama",
        max_position_embeddings=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
    )


def test_a_real_step_several_heartbeat_timeouts_long_is_not_a_hang(wide_dir, monkeypatch):
    monkeypatch.setenv(HEARTBEAT_TIMEOUT_ENV, "0.3")
    monkeypatch.setenv(ITERATION_TIMEOUT_ENV, "30")
    llm = LLM(
        str(wide_dir),
        device="cpu",
        dtype="float32",
        kv_cache_memory=0.1,
        max_num_batched_tokens=8192,
        engine_process=True,
    )
    client = llm.llm_engine.client
    heard = []
    real_heard = client._watch.heard
    monkeypatch.setattr(client._watch, "heard", lambda m: (heard.append(m), real_heard(m)))
    try:
        start = time.monotonic()
        out = llm.generate(
            [{"prompt_token_ids": [5 + i % 400 for i in range(8000)]}], SamplingParams(max_tokens=1), use_tqdm=False
        )
        took = time.monotonic() - start
        assert out[0].finished and client.is_alive
        longest = max((m.step_s for m in heard if isinstance(m, EngineCoreHeartbeat)), default=0.0)
        print(f"8000-token prefill: {took:.2f}s, longest step a heartbeat saw: {longest:.2f}s")
        if took > 0.9:  # on a fast machine the step may be too short to show anything
            assert longest > 0.3, "the core's heartbeats kept coming while its main thread was in the step"
    finally:
        llm.llm_engine.shutdown()
    assert client.proc.returncode == 0


# ---- 4. `ember serve` with the default timeouts -----------------------------------------------------


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("long") / "llama", "llama", max_position_embeddings=8192)


def test_sigstop_of_the_core_ends_the_stream_within_5s_then_503_and_the_server_exits_1(long_dir, tmp_path):
    with Serve(long_dir, tmp_path / "serve.err", "--kv-cache-memory", "0.05") as server:
        core = server.core_pid
        streams = [_Stream(server.url, {**LONG, "prompt": [5, 17, i, 203, 40], "max_tokens": 7000}) for i in range(2)]
        for s in streams:
            assert s.started.wait(30) and s.error is None and s.events, (s.error, s.events)
        os.kill(core, signal.SIGSTOP)
        stopped = time.monotonic()
        for s in streams:
            s.join(15)
        detected = time.monotonic() - stopped
        print(f"SIGSTOP of the core: streams ended after {detected:.2f}s")
        assert detected < 4.5 + 1.5, detected  # 4.5 s, plus slack for a loaded CI machine
        for s in streams:
            assert s.events[-1] == "[DONE]", s.events[-3:]
            error = json.loads(s.events[-2])["error"]
            assert error["type"] == "service_unavailable", error
            assert "engine core stopped answering: no heartbeat for" in error["message"], error
        assert httpx.get(server.url + "/health", timeout=2).status_code == 503
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503, r.text
        code = server.proc.wait(15)
        assert code == 1, "the server exits non-zero so that a supervisor restarts it"
        assert time.monotonic() - stopped < 15
        assert not _alive(core), "the stopped core was killed, not left behind"
        err = server.stderr()
        assert "Traceback" not in err, err
        assert "stopped answering" in err and "did not stop" not in err, err
