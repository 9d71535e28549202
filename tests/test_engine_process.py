"""The engine core in its own process: same results as in-process, and every way the pair can end.

Since the restructuring, `ember serve` (and `AsyncLLM`, and `LLM(engine_process=True)`) run the
engine core in a separate process behind ZMQ, with the front end doing tokenization, stop strings
and the HTTP side. Splitting one program into two creates failure modes neither half shows alone,
so this module checks, against real processes:

- results: the multiprocess client and the in-process one (also with async scheduling) give the
  same tokens, texts, finish reasons and logprobs for the same requests, including n > 1 with
  seeds, stop strings (found by the front end, which must then abort the core's request),
  logprobs, prompt logprobs, and a KV cache so small that the scheduler preempts;
- KV blocks: 64 streams whose clients vanish or give up all free their blocks in the core, as the
  server's /metrics shows, and the server keeps serving;
- the core dying (kill -9) mid-stream: every stream ends with an error event, /health turns 503,
  the server exits 1 so a supervisor restarts it, and nothing is left running;
- SIGTERM under load: running streams finish, new work gets 503, both processes exit, 0;
- the front end dying (kill -9): the core notices and exits instead of living on as an orphan;
- a core that cannot start: its own exception becomes the server's one-line error, exit code 2;
- the front end never imports torch (only the core process maps libtorch).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port, make_checkpoint
from test_server_robustness import raw_post, wait_until
from test_tensor_parallel import _alive, _descendants

from ember import LLM, SamplingParams

CORE_MODULE = "ember.core.process"
LONG = {"ignore_eos": True, "temperature": 0}


# ---- 1. the same results in and out of process --------------------------------------------------


def _llm(model: Path, **kwargs) -> LLM:
    return LLM(str(model), device="cpu", dtype="float32", seed=0, **kwargs)


def _token_prompts(seed: int, count: int, lo: int, hi: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randint(5, 511) for _ in range(rng.randint(lo, hi))]} for _ in range(count)]


def _assert_logprobs_close(got, ref, where: str) -> None:
    """Logprob lists (sample or prompt) equal up to 1e-5: same positions, same top tokens in the same
    order with the same ranks and texts."""
    if ref is None:
        assert got is None, where
        return
    assert got is not None and len(got) == len(ref), where
    for pos, (g, r) in enumerate(zip(got, ref)):
        if r is None:
            assert g is None, f"{where}[{pos}]"
            continue
        assert list(g) == list(r), f"{where}[{pos}]: top tokens {list(g)} != {list(r)}"
        for tid in r:
            assert g[tid].rank == r[tid].rank and g[tid].decoded_token == r[tid].decoded_token, f"{where}[{pos}]"
            assert abs(g[tid].logprob - r[tid].logprob) <= 1e-5, (where, pos, tid, g[tid].logprob, r[tid].logprob)


def _assert_same_results(got, ref, label: str) -> None:
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        where = f"{label}: prompt {i}"
        assert g.finished and g.error is None, where
        assert g.prompt_token_ids == r.prompt_token_ids, where
        _assert_logprobs_close(g.prompt_logprobs, r.prompt_logprobs, f"{where} prompt_logprobs")
        assert [o.index for o in g.outputs] == [o.index for o in r.outputs], where
        for go, ro in zip(g.outputs, r.outputs):
            seq = f"{where} seq {ro.index}"
            assert go.token_ids == ro.token_ids, seq
            assert go.text == ro.text, seq
            assert (go.finish_reason, go.stop_reason) == (ro.finish_reason, ro.stop_reason), seq
            _assert_logprobs_close(go.logprobs, ro.logprobs, f"{seq} logprobs")
            if ro.cumulative_logprob is None:
                assert go.cumulative_logprob is None, seq
            else:
                assert math.isclose(go.cumulative_logprob, ro.cumulative_logprob, abs_tol=1e-4), seq


def _pick_stop_string(text: str) -> tuple[str, int] | None:
    """Three printable ASCII characters that first occur after the start of `text`."""
    for k in range(2, len(text) - 3):
        s = text[k : k + 3]
        if all(c.isascii() and c.isalnum() for c in s) and text.find(s) == k:
            return s, k
    return None


def _mixed_requests(ref: LLM) -> tuple[list[tuple[list, list]], list[tuple[int, str, str, list[int]]]]:
    """Two generate calls' worth of (prompts, params): one that async scheduling can run two steps
    deep, one with prompt logprobs (which makes the core go one step at a time while they run).
    Stop strings are cut from the reference's own greedy texts so that they do occur."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    prompts = _token_prompts(3, 6, 3, 120) + ["The quick brown fox", "Paris is the capital of"]
    params = [greedy] * len(prompts)
    prompts += [prompts[0], prompts[6], prompts[1]]
    params += [
        SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(n=2, temperature=0.7, top_k=50, seed=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True, logprobs=1),
    ]
    # Stop strings: the front end finds them in the text and aborts the request in the core.
    probe_prompts = _token_prompts(8, 6, 5, 60) + ["Large language models generate"]
    full = ref.generate(probe_prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    stops = []
    for p, out in zip(probe_prompts, full):
        found = _pick_stop_string(out.outputs[0].text)
        if found is not None:
            stop, at = found
            stops.append((len(prompts), stop, out.outputs[0].text[:at], out.outputs[0].token_ids))
            prompts.append(p)
            params.append(
                SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop, "~~never~~"], logprobs=1)
            )
    assert len(stops) >= 3, "the probe texts should offer stop strings"
    host_sync_prompts = _token_prompts(5, 3, 4, 90) + ["Paris is the capital of"]
    host_sync_params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=3)
    ] * 3
    host_sync_params.append(
        SamplingParams(n=2, temperature=1.0, seed=21, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    )
    return [(prompts, params), (host_sync_prompts, host_sync_params)], stops


def _preemption_requests() -> list[tuple[list, list]]:
    """test_batching's preemption workload (32 prompts of 3 to 200 tokens in 40 KV blocks), with
    logprobs, plus seeded samples with n > 1 that must survive preemption unchanged."""
    prompts = _token_prompts(1, 32, 3, 200)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)] * 32
    prompts += prompts[:4]
    params += [
        SamplingParams(n=2, temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True, logprobs=1) for i in range(4)
    ]
    return [(prompts, params)]


_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, block of 16, kv heads, head_dim, fp32
CONFIGS = {
    "mixed": {"kv_cache_memory": 0.05, "max_model_len": 512},
    "preemption": {"kv_cache_memory": 40 * _BLOCK_BYTES / 2**30, "block_size": 16, "max_model_len": 256},
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_engine_process_matches_in_process(llama_dir, config):
    """One in-process LLM (the reference), one with async scheduling, one over the core process."""
    engine_args = CONFIGS[config]
    ref = _llm(llama_dir, **engine_args)
    calls, stops = _mixed_requests(ref) if config == "mixed" else (_preemption_requests(), [])
    others = {"async": _llm(llama_dir, async_scheduling=True, **engine_args)}
    mp = others["process"] = _llm(llama_dir, engine_process=True, **engine_args)
    core = mp.llm_engine.client.proc
    try:
        assert mp.llm_engine.ready.num_blocks == ref.llm_engine.ready.num_blocks
        assert CORE_MODULE in " ".join(core.args) and core.poll() is None
        expected = [ref.generate(prompts, params, use_tqdm=False) for prompts, params in calls]
        for row, stop, text, full_ids in stops:
            out = expected[0][row].outputs[0]
            assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, text)
            assert len(out.token_ids) < len(full_ids) and out.token_ids == full_ids[: len(out.token_ids)]
        # Seeds per sequence: a request's n samples differ from each other.
        assert any(
            len(o.outputs) > 1 and len({tuple(c.token_ids) for c in o.outputs}) == len(o.outputs) for o in expected[0]
        )
        for name, llm in others.items():
            for i, (prompts, params) in enumerate(calls):
                _assert_same_results(llm.generate(prompts, params, use_tqdm=False), expected[i], f"{name} call {i}")
        for name, llm in [("in-process", ref), *others.items()]:
            stats = llm.llm_engine.scheduler_stats()
            assert (stats.kv_cache_usage, stats.num_running, stats.num_waiting) == (0.0, 0, 0), name
            if config == "preemption":
                assert llm.llm_engine.ready.num_blocks == 40
                assert stats.num_preemptions > 0, name
    finally:
        mp.llm_engine.shutdown()
    assert core.returncode == 0, "asked to stop, the core process stops by itself"


# ---- `ember serve` in a subprocess --------------------------------------------------------------


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory) -> Path:
    """The tiny model with room for streams of thousands of tokens."""
    return make_checkpoint(tmp_path_factory.mktemp("long") / "llama", "llama", max_position_embeddings=8192)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class Serve:
    """`python -m ember.server.launch` with its stderr in a file (a pipe nobody reads could fill up and
    stall it). Use as a context manager: on exit every process it started is killed, whatever happened."""

    def __init__(self, model_dir: Path, log: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "EMBER_LOGGING_LEVEL": "WARNING"}
        env.pop("EMBER_API_KEY", None)
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ember.server.launch",
                    str(model_dir),
                    "--port",
                    str(self.port),
                    "--device",
                    "cpu",
                    "--dtype",
                    "float32",
                    *flags,
                ],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
            )
        self.pids: set[int] = set()  # every descendant seen, killed at exit if still there
        self.core_pid = -1

    def __enter__(self) -> Serve:
        try:
            deadline = time.monotonic() + 60
            while not self._healthy():
                assert self.proc.poll() is None, f"ember serve exited {self.proc.returncode}: {self.stderr()}"
                assert time.monotonic() < deadline, "ember serve did not become healthy"
                time.sleep(0.05)
            cores = [p for p in self.descendants() if CORE_MODULE in _cmdline(p)]
            assert len(cores) == 1, [_cmdline(p) for p in self.descendants()]
            self.core_pid = cores[0]
        except BaseException:
            self.__exit__()
            raise
        return self

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def descendants(self) -> list[int]:
        try:
            found = _descendants(self.proc.pid)
        except OSError:  # the server is gone
            found = []
        self.pids.update(found)
        return found

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def __exit__(self, *exc) -> None:
        self.descendants()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        for pid in self.pids:  # by pid, and only if it is still one of ours
            if _alive(pid) and "ember" in _cmdline(pid):
                os.kill(pid, signal.SIGKILL)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        values = {}
        for line in text.splitlines():
            if line.startswith("ember:") and "{" in line:
                values[line.partition("{")[0]] = float(line.rsplit(" ", 1)[1])
        return values

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60)


def _wait_for_data(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """Read from a raw streaming response until its first event has arrived."""
    sock.settimeout(timeout)
    received = b""
    while b"\ndata: " not in received:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before the first event: {received!r}"
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received[:200]
    return received


class _Stream:
    """A streaming completion read in a thread: its `data:` payloads, and the exception that ended it, if any."""

    def __init__(self, url: str, body: dict) -> None:
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.started.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.started.set()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None, repr(self.error)


def _abrupt_close(sock: socket.socket) -> None:
    """Close with a TCP reset, like a client that crashed."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _polite_close(sock: socket.socket) -> None:
    """Close with a FIN, like a client that gave up on the request (an HTTP library's abort)."""
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _all_idle(server: Serve) -> bool:
    m = server.metrics()
    return (m["ember:kv_cache_usage_perc"], m["ember:num_requests_running"], m["ember:num_requests_waiting"]) == (
        0,
        0,
        0,
    )


# ---- 2. vanishing clients free every KV block ---------------------------------------------------


def test_64_vanishing_streams_free_every_kv_block(long_dir, tmp_path):
    # 0.25 GiB holds 64 streams of the full 8192-token context: nothing waits or is preempted.
    with Serve(long_dir, tmp_path / "serve.err", "--kv-cache-memory", "0.25") as server:
        socks = []
        try:
            for i in range(64):
                path = "/v1/chat/completions" if i % 4 == 3 else "/v1/completions"
                body = {**LONG, "max_tokens": 7000, "stream": True}
                if "chat" in path:
                    body["messages"] = [{"role": "user", "content": f"Tell story number {i}"}]
                else:
                    body["prompt"] = [5 + i, 17, 99, 203, 40 + i]
                socks.append(raw_post(server.url, path, body))
            # Non-streaming requests whose client goes away are aborted the same way.
            plain = [
                raw_post(server.url, "/v1/completions", {**LONG, "max_tokens": 7000, "prompt": [7, i, 9, 11]})
                for i in range(8)
            ]
            for sock in socks:
                _wait_for_data(sock)
            wait_until(lambda: server.metrics()["ember:num_requests_running"] == 72, timeout=30)
            m = server.metrics()
            assert m["ember:kv_cache_usage_perc"] > 0 and m["ember:num_requests_waiting"] == 0
            assert m["ember:num_preemptions_total"] == 0
            closed = time.monotonic()
            for i, sock in enumerate(socks + plain):
                (_abrupt_close if i % 2 == 0 else _polite_close)(sock)
            wait_until(lambda: _all_idle(server), timeout=5)
            assert time.monotonic() - closed < 5
        finally:
            for sock in socks + plain:
                sock.close()
        r = server.post("/v1/completions", {**LONG, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert _all_idle(server)
        assert server.proc.poll() is None and _alive(server.core_pid)
        assert "Traceback" not in server.stderr(), server.stderr()


# ---- 3. the core killed mid-stream --------------------------------------------------------------


def test_kill_9_of_the_core_ends_every_stream_with_an_error_and_the_server_exits_1(long_dir, tmp_path):
    with Serve(long_dir, tmp_path / "serve.err", "--kv-cache-memory", "0.05") as server:
        core = server.core_pid
        streams = [_Stream(server.url, {**LONG, "prompt": [5, 17, i, 203, 40], "max_tokens": 7000}) for i in range(16)]
        for s in streams:
            assert s.started.wait(30)
            assert s.error is None and s.events, (s.error, s.events)
        wait_until(lambda: server.metrics()["ember:num_requests_running"] == 16, timeout=30)
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        health = []  # (seconds since the kill, status or None when refused)
        while time.monotonic() - killed < 2.0:
            try:
                status = httpx.get(server.url + "/health", timeout=0.5).status_code
            except httpx.TransportError:
                status = None
            health.append((round(time.monotonic() - killed, 2), status))
            time.sleep(0.05)
        assert any(status == 503 for _, status in health), health
        assert all(status in (200, 503, None) for _, status in health), health
        for s in streams:
            s.join(10)
            assert s.events[-1] == "[DONE]", s.events[-3:]
            error = json.loads(s.events[-2])["error"]
            assert error["type"] == "service_unavailable", error
            assert "engine" in error["message"] and "SIGKILL" in error["message"], error
            assert all("error" not in json.loads(e) for e in s.events[:-2])
        code = server.proc.wait(10)
        assert code == 1, "the server exits non-zero so that a supervisor restarts it"
        assert time.monotonic() - killed < 10
        wait_until(lambda: not any(_alive(p) for p in server.pids | {core}), timeout=5)
        err = server.stderr()
        assert "Traceback" not in err, err
        assert "killed by SIGKILL" in err


# ---- 4. SIGTERM under load ---------------------------------------------------------------------


def test_sigterm_under_load_finishes_running_streams_then_both_processes_exit_0(long_dir, tmp_path):
    with Serve(long_dir, tmp_path / "serve.err", "--kv-cache-memory", "0.05", "--shutdown-timeout", "60") as server:
        core = server.core_pid
        max_tokens = 1500
        streams = [
            _Stream(
                server.url,
                {
                    **LONG,
                    "prompt": [9, 17, i, 203, 40],
                    "max_tokens": max_tokens,
                    "stream_options": {"include_usage": True},
                },
            )
            for i in range(4)
        ]
        for s in streams:
            assert s.started.wait(30) and s.events
        wait_until(lambda: server.metrics()["ember:num_requests_running"] == 4, timeout=30)
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(server.url + "/health").status_code == 503, timeout=5)
        r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert all(s.thread.is_alive() for s in streams), "the streams should still run while the server drains"
        assert _alive(core), "the core keeps running until the drain is over"
        for s in streams:
            s.join(60)
            assert s.events[-1] == "[DONE]", s.events[-3:]
            chunks = [json.loads(e) for e in s.events[:-1]]
            assert all("error" not in c for c in chunks), chunks[-3:]
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
            assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
        assert server.proc.wait(30) == 0
        wait_until(lambda: not any(_alive(p) for p in server.pids | {core}), timeout=10)
        err = server.stderr()
        assert "Traceback" not in err, err
        assert "did not stop" not in err, "asked to stop, the core should stop by itself, not be killed"


# ---- 5. the front end killed --------------------------------------------------------------------


def test_kill_9_of_the_front_end_ends_the_core(llama_dir, tmp_path):
    with Serve(llama_dir, tmp_path / "serve.err", "--kv-cache-memory", "0.02") as server:
        core = server.core_pid
        assert server.post("/v1/completions", {**LONG, "prompt": "hi", "max_tokens": 3}).status_code == 200
        server.proc.kill()
        assert server.proc.wait(10) == -signal.SIGKILL
        killed = time.monotonic()
        wait_until(lambda: not any(_alive(p) for p in server.pids | {core}), timeout=5)
        assert time.monotonic() - killed < 5
        assert "front end is gone" in server.stderr()


# ---- 6. a core that cannot start ----------------------------------------------------------------


def test_core_start_failure_is_a_one_line_error_naming_the_file(llama_dir, tmp_path):
    model = tmp_path / "corrupt"
    model.mkdir()
    for f in llama_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # an interrupted download
    env = {**os.environ, "EMBER_LOGGING_LEVEL": "WARNING"}
    r = subprocess.run(
        [sys.executable, "-m", "ember.server.launch", str(model), "--port", "0", "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error:"), r.stderr
    assert str(weights) in lines[-1] and "corrupt" in lines[-1], lines[-1]
    assert "Traceback" not in r.stderr, r.stderr


class _LatePoller:
    """A poller whose first poll ends before the core's message arrives: the race CI hit once."""

    def __init__(self, poller):
        self.poller, self.missed = poller, False

    def poll(self, timeout):
        if not self.missed:
            self.missed = True
            return []
        return self.poller.poll(timeout)


def test_a_failure_sent_just_before_the_core_exits_is_not_lost(llama_dir, tmp_path):
    from ember.config import EngineArgs
    from ember.frontend.core_client import MPClient
    from ember.frontend.errors import EngineStartError

    model = tmp_path / "corrupt"
    model.mkdir()
    for f in llama_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    os.truncate(model / "model.safetensors", 100)
    client = MPClient(EngineArgs(model=str(model), device="cpu").engine_config())
    assert client.proc.wait(120) == 1  # it sent its failure, then exited, before the client looked
    client._poller = _LatePoller(client._poller)
    with pytest.raises(EngineStartError, match="model.safetensors"):
        client.wait_ready()


# ---- 7. no torch in the front end ---------------------------------------------------------------


def test_front_end_never_imports_torch(llama_dir, tmp_path):
    with Serve(llama_dir, tmp_path / "serve.err", "--kv-cache-memory", "0.02") as server:
        r = server.post("/v1/completions", {**LONG, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
        with open(f"/proc/{server.proc.pid}/maps") as f:
            front = f.read()
        with open(f"/proc/{server.core_pid}/maps") as f:
            core = f.read()
        assert "libtorch" in core
        assert "libtorch" not in front, [line for line in front.splitlines() if "torch" in line][:5]
