"""`ember bench serve`: against a real `ember serve` on the tiny llama checkpoint, and against canned responses."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import queue
import re
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ember import cli
from ember.bench.client import send_request
from ember.bench.flags import add_serve_bench_args
from ember.bench.processes import _in_request_order, deal, num_processes
from ember.bench.report import STATS, RequestResult, distribution, error_kind, most_in_flight
from ember.bench.workloads import RequestSpec, arrival_times, make_requests, nano_vllm_requests, request_body
from ember.http_client import APIS, CHAT, COMPLETIONS, MESSAGES, RESPONSES, carries_output

MAX_MODEL_LEN = 128
RESULT_KEYS = {
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "total_token_throughput",
    "max_concurrency_observed",
    "failures_by_kind",
    "errors",
    *(f"{stat}_{metric}_ms" for stat in STATS for metric in ("ttft", "tpot", "itl", "e2el")),
}
REQUEST_KEYS = {
    "success",
    "error",
    "start_s",
    "prompt_tokens",
    "max_tokens",
    "output_tokens",
    "ttft_ms",
    "tpot_ms",
    "e2el_ms",
}


# ---- a real server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_url(llama_dir):
    yield from _serve(llama_dir)


def _serve(llama_dir, *flags: str):
    """`ember serve` in a subprocess on a free port; its start-up log line says which."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ember.server.launch",
            str(llama_dir),
            "--port",
            "0",
            "--device",
            "cpu",
            "--kv-cache-memory",
            "0.05",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            *flags,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    url, log, deadline = None, [], time.monotonic() + 120
    while url is None and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        log.append(line)
        if m := re.search(r"serving .* at (http://\S+) ", line):
            url = m.group(1)
    try:
        assert url is not None, "ember serve did not start:\n" + "".join(log)
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            assert resp.status == 200
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_bench(tmp_path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    rc = cli.main(["bench", "serve", "--vocab-size", "512", "--disable-tqdm", "--result-file", str(out), *flags])
    return rc, json.loads(out.read_text())


def check_consistent(doc: dict, n: int) -> None:
    r = doc["results"]
    assert set(r) >= RESULT_KEYS
    assert {"benchmark", "date", "label", "machine", "command", "server", "config", "results", "requests"} <= set(doc)
    assert {"hostname", "cpu", "torch", "ember_commit"} <= set(doc["machine"])
    assert len(doc["requests"]) == n and all(set(q) >= REQUEST_KEYS for q in doc["requests"])
    ok = [q for q in doc["requests"] if q["success"]]
    assert r["completed"] == len(ok) and r["failed"] == n - len(ok)
    for q in ok:
        assert 0 < q["ttft_ms"] <= q["e2el_ms"]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        if ok and r[f"median_{metric}_ms"] is None:
            assert metric == "itl"  # no gaps: every request's tokens arrived in one chunk (a fast engine)
        elif ok:
            assert r[f"median_{metric}_ms"] <= r[f"p90_{metric}_ms"] <= r[f"p99_{metric}_ms"]
        else:
            assert r[f"median_{metric}_ms"] is r[f"p99_{metric}_ms"] is None
    assert r["request_throughput"] == pytest.approx(r["completed"] / r["duration_s"], rel=1e-3)
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration_s"], rel=1e-3)
    assert r["total_output_tokens"] == sum(q["output_tokens"] for q in ok)
    assert r["total_input_tokens"] == sum(q["prompt_tokens"] for q in ok)


def test_all_at_once_fixed_lengths(server_url, tmp_path):
    rc, doc = run_bench(
        tmp_path,
        "--base-url",
        server_url,
        "--num-prompts",
        "12",
        "--dataset",
        "fixed",
        "--random-input-len",
        "16",
        "--random-output-len",
        "8",
        "--label",
        "inf",
    )
    assert rc == 0
    check_consistent(doc, 12)
    r = doc["results"]
    assert (r["completed"], r["failed"]) == (12, 0), r["errors"]
    assert all(q["prompt_tokens"] == 16 and q["output_tokens"] == 8 for q in doc["requests"])
    assert r["total_output_tokens"] == 96 and r["total_input_tokens"] == 192
    assert 1 < r["max_concurrency_observed"] <= 12
    assert doc["server"]["model"] == doc["server"]["models"][0]["id"]  # found through /v1/models
    assert doc["label"] == "inf" and doc["config"]["request_rate"] is None
    assert "api_key" not in doc["config"]


def test_speculative_decoding_figures(llama_dir, server_url, tmp_path):
    """Against a server with n-gram speculation the report carries acceptance from its /metrics
    counters, over this run only; a plain server has none."""
    flags = ["--num-prompts", "8", "--dataset", "fixed", "--random-input-len", "64", "--random-output-len", "48"]
    _, plain = run_bench(tmp_path, "--base-url", server_url, *flags)
    assert plain["results"]["spec_decode"] is None
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "draft_token_budget": 64}'
    for url in _serve(llama_dir, "--speculative-config", config):
        runs = [run_bench(tmp_path, "--base-url", url, *flags)[1]["results"]["spec_decode"] for _ in range(2)]
    for spec in runs:
        assert spec["num_drafts"] > 0 and 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
        assert spec["acceptance_rate"] == pytest.approx(spec["num_accepted_tokens"] / spec["num_draft_tokens"])
        assert len(spec["acceptance_per_position"]) == 3
    assert runs[1]["num_drafts"] < runs[0]["num_drafts"] * 2  # the second run's, not the sum of both


def test_poisson_arrivals_with_concurrency_cap(server_url, tmp_path):
    rc, doc = run_bench(
        tmp_path,
        "--base-url",
        server_url,
        "--num-prompts",
        "12",
        "--request-rate",
        "30",
        "--max-concurrency",
        "4",
        "--random-input-len",
        "16",
        "--random-output-len",
        "8",
        "--random-range-ratio",
        "0.5",
        "--seed",
        "3",
    )
    assert rc == 0
    check_consistent(doc, 12)
    r = doc["results"]
    assert r["completed"] == 12, r["errors"]
    reqs = doc["requests"]
    assert all(q["output_tokens"] == q["max_tokens"] for q in reqs)  # ignore_eos: exactly the lengths asked for
    assert all(4 <= q["max_tokens"] <= 12 and 8 <= q["prompt_tokens"] <= 24 for q in reqs)
    assert len({q["max_tokens"] for q in reqs}) > 1
    assert r["max_concurrency_observed"] <= 4
    assert max(q["start_s"] for q in reqs) > 0  # spread out in time, not all at once
    assert doc["config"]["request_rate"] == 30


def test_chat_endpoint(server_url, tmp_path):
    rc, doc = run_bench(
        tmp_path,
        "--base-url",
        server_url,
        "--endpoint",
        "/v1/chat/completions",
        "--num-prompts",
        "4",
        "--dataset",
        "fixed",
        "--input-len",
        "3",
        "--output-len",
        "6",
    )
    assert rc == 0
    check_consistent(doc, 4)
    assert doc["results"]["completed"] == 4, doc["results"]["errors"]
    # input tokens come from the server's usage: the chat template's tokens are counted too
    assert all(q["output_tokens"] == 6 and q["prompt_tokens"] > 3 for q in doc["requests"])


def test_responses_and_messages_endpoints_send_the_chat_workload(server_url, tmp_path):
    """The same prompts and lengths through each API's own request shape and events: the same token counts."""
    flags = ("--base-url", server_url, "--num-prompts", "4", "--dataset", "fixed", "--input-len", "5")
    tokens = {}
    for endpoint in (CHAT, RESPONSES, MESSAGES):
        rc, doc = run_bench(tmp_path, *flags, "--output-len", "6", "--endpoint", endpoint)
        assert rc == 0
        check_consistent(doc, 4)
        assert doc["results"]["completed"] == 4, doc["results"]["errors"]
        assert doc["server"]["endpoint"] == endpoint
        tokens[endpoint] = [(q["prompt_tokens"], q["output_tokens"]) for q in doc["requests"]]
        assert all(q["ttft_ms"] < q["e2el_ms"] and q["tpot_ms"] > 0 for q in doc["requests"])
    assert tokens[RESPONSES] == tokens[MESSAGES] == tokens[CHAT]
    assert all(p > 5 and n == 6 for p, n in tokens[CHAT])  # ignore_eos reached the engine through every API


def test_requests_beyond_the_context_fail_cleanly(server_url, tmp_path):
    rc, doc = run_bench(
        tmp_path,
        "--base-url",
        server_url,
        "--num-prompts",
        "4",
        "--dataset",
        "fixed",
        "--random-input-len",
        str(MAX_MODEL_LEN + 10),
        "--random-output-len",
        "8",
    )
    assert rc == 1  # nothing succeeded; the report and the file are complete all the same
    check_consistent(doc, 4)
    r = doc["results"]
    assert (r["completed"], r["failed"]) == (0, 4)
    assert r["failures_by_kind"] == {"HTTP 400": 4}
    assert sum(e["count"] for e in r["errors"]) == 4
    assert "context length" in r["errors"][0]["message"]
    assert r["mean_ttft_ms"] is None and r["request_throughput"] == 0


def run_script(script: str, *flags: str) -> subprocess.CompletedProcess:
    """A benchmarks/ client script in its own interpreter, as it is run (it puts the repository on its path)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--vocab-size", "512", *flags],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_serve_sweep_script(server_url, tmp_path):
    out = tmp_path / "sweep.json"
    r = run_script(
        "serve_sweep.py",
        "--base-url",
        server_url,
        "--dataset",
        "fixed",
        "--num-prompts",
        "6",
        "--sweep-prompts",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--fractions",
        "0.5",
        "1",
        "--disable-tqdm",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert {"benchmark", "date", "machine", "command", "config", "results"} <= set(doc)
    sat, runs = doc["results"]["saturation"], doc["results"]["runs"]
    assert sat["completed"] == 6 and sat["offered_request_rate"] is None and sat["seed"] == 0
    assert [(q["fraction"], q["seed"], q["completed"]) for q in runs] == [(0.5, 1, 4), (1.0, 2, 4)]
    for q in runs:
        assert q["offered_request_rate"] == pytest.approx(q["fraction"] * sat["request_throughput"], rel=1e-3)
        assert q["median_ttft_ms"] <= q["p99_ttft_ms"] and q["meets_ttft_p99_target"] == (q["p99_ttft_ms"] <= 150)


def test_openai_client_script(server_url, tmp_path):
    pytest.importorskip("openai")
    out = tmp_path / "openai.json"
    r = run_script(
        "openai_client.py",
        "--base-url",
        server_url,
        "--dataset",
        "fixed",
        "--num-prompts",
        "5",
        "--input-len",
        "8",
        "--output-len",
        "6",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    check_consistent(doc, 5)
    res = doc["results"]
    assert res["completed"] == 5 and res["total_output_tokens"] == 30  # ignore_eos went through extra_body
    assert doc["config"]["max_connections"] == 5 and doc["config"]["temperature"] == 0.6
    assert all(q["ttft_text_ms"] is None or q["ttft_text_ms"] >= q["ttft_ms"] for q in doc["requests"])


def test_server_down(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert cli.main(["bench", "serve", "--base-url", url, "--num-prompts", "2"]) == 2  # no model to ask for
    rc, doc = run_bench(tmp_path, "--base-url", url, "--model", "m", "--num-prompts", "3")
    assert rc == 1
    assert doc["results"]["failures_by_kind"] == {"ConnectionRefusedError": 3}


def server_counts(url: str) -> tuple[float, float]:
    """(finished requests, generated tokens) so far, from the server's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    totals = dict.fromkeys(("ember:request_success_total", "ember:generation_tokens_total"), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals["ember:request_success_total"], totals["ember:generation_tokens_total"]


def test_num_clients_send_the_same_requests_once_each(server_url, tmp_path):
    """Two client processes send the one-process run's requests (same seed), each once, and report them alike."""
    flags = ["--base-url", server_url, "--num-prompts", "7", "--max-concurrency", "3", "--random-input-len", "12"]
    flags += ["--random-output-len", "5", "--random-range-ratio", "0.5", "--seed", "4"]
    docs = {}
    for n in (1, 2):
        before = server_counts(server_url)
        rc, docs[n] = run_bench(tmp_path, *flags, "--num-clients", str(n))
        assert rc == 0
        check_consistent(docs[n], 7)
        r = docs[n]["results"]
        assert r["completed"] == 7 and r["client_processes"] == n and docs[n]["config"]["num_clients"] == n
        assert 1 <= r["max_concurrency_observed"] <= 3
        deadline = time.monotonic() + 10  # the server counts a request as it finishes, maybe just after its stream
        while server_counts(server_url)[0] < before[0] + 7 and time.monotonic() < deadline:
            time.sleep(0.05)
        after = server_counts(server_url)
        assert (after[0] - before[0], after[1] - before[1]) == (7, r["total_output_tokens"])
    sent = {
        n: [(q["prompt_tokens"], q["max_tokens"], q["output_tokens"]) for q in d["requests"]] for n, d in docs.items()
    }
    assert sent[2] == sent[1] and len(set(sent[1])) > 1  # the same requests, in request order
    keys = ("completed", "failed", "total_input_tokens", "total_output_tokens")
    assert [docs[2]["results"][k] for k in keys] == [docs[1]["results"][k] for k in keys]


def test_deal_splits_requests_round_robin_and_the_cap_evenly():
    specs = [RequestSpec([i], 1, 1) for i in range(7)]
    shares = deal(specs, [0.1 * i for i in range(7)], 5, 3)
    assert [[s.prompt[0] for s in share.specs] for share in shares] == [[0, 3, 6], [1, 4], [2, 5]]
    assert [list(share.times) for share in shares][1] == [0.1, 0.4]
    assert [share.max_concurrency for share in shares] == [2, 2, 1]
    assert [share.max_concurrency for share in deal(specs, [0.0] * 7, None, 2)] == [None, None]
    assert _in_request_order([list(share.specs) for share in shares]) == specs
    assert (num_processes(8, 3, None), num_processes(8, 100, 2), num_processes(4, 100, None)) == (3, 2, 4)


def test_most_in_flight_counts_overlaps_from_any_process():
    def res(start: float, end: float) -> RequestResult:
        r = RequestResult(1, 1)
        r.start_s, r.end_s = start, end
        return r

    assert most_in_flight([res(0, 2), res(1, 3), res(2, 4), res(2.5, 2.6)]) == 3  # at 2: one ends as one starts
    assert most_in_flight([]) == 0


@pytest.mark.parametrize("value", ["0", "-2"])
def test_num_clients_must_be_positive(value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "serve", "--num-clients", value])
    assert e.value.code == 2
    assert f"argument --num-clients: must be >= 1, got {value}" in capsys.readouterr().err


class HangingServer(socketserver.ThreadingTCPServer):
    """Answers GET with 404 and never answers a POST: requests that stay in flight until the test ends."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), self.Handler)
        self.posts: list[bytes] = []  # appended from the handlers' threads
        self.done = threading.Event()

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            line = self.rfile.readline()
            if line.startswith(b"POST"):
                self.server.posts.append(line)
                self.server.done.wait()
            else:
                self.wfile.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


def test_a_client_process_that_dies_is_an_error_not_a_hang(capsys):
    server = HangingServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    rc: list[int] = []
    flags = ["--model", "m", "--num-prompts", "4", "--num-clients", "2", "--disable-tqdm", "--vocab-size", "512"]
    bench = threading.Thread(target=lambda: rc.append(cli.main(["bench", "serve", "--base-url", url, *flags])))
    try:
        bench.start()
        deadline = time.monotonic() + 60
        while len(server.posts) < 4 and time.monotonic() < deadline:  # every request in flight, in both processes
            time.sleep(0.05)
        assert len(server.posts) == 4
        victim = next(p for p in multiprocessing.active_children() if p.name == "ember-bench-client1")
        os.kill(victim.pid, signal.SIGKILL)
        bench.join(30)  # not the 600 s of --request-timeout
        assert not bench.is_alive() and rc == [1]
    finally:
        server.done.set()
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert "error: client process 1 " in err and "exited with code -9 before it was done" in err
    assert not multiprocessing.active_children()  # the other one was stopped too


# ---- the client against canned responses ------------------------------------------------------------


def sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def chunked(body: bytes, size: int) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\nX-Trailer: 1\r\n\r\n"


def completion(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}
STREAM = sse(completion("a"), completion("b"), completion("cd"), completion("", "length"), USAGE, "[DONE]")


def canned(response: bytes, piece: int = 7, pause: float = 0.002, hang: bool = False, endpoint: str = COMPLETIONS):
    """Run one request through `send_request` against a server that answers `response` in small pieces."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(f"POST {endpoint} ".encode())
        length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
        body = json.loads(await reader.readexactly(length))
        assert body["stream"] and body.get("stream_options") == APIS[endpoint].stream.get("stream_options")
        if hang:
            await asyncio.sleep(10)
        for i in range(0, len(response), piece):
            writer.write(response[i : i + piece])
            await writer.drain()
            await asyncio.sleep(pause)
        writer.close()

    async def main() -> RequestResult:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        spec = RequestSpec([1, 2, 3] if endpoint == COMPLETIONS else "a b c", 3, 4)
        args = argparse.Namespace(endpoint=endpoint, temperature=0.0, ignore_eos=True, extra_body=None)
        try:
            return await send_request(
                f"http://127.0.0.1:{port}{endpoint}",
                request_body(args, "m", spec),
                {},
                APIS[endpoint],
                spec,
                timeout=0.5 if hang else 10,
                t0=time.perf_counter(),
            )
        finally:
            server.close()

    return asyncio.run(main())


def test_chunked_sse_split_anywhere():
    head = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    res = canned(head + chunked(STREAM.replace(b"\n", b"\r\n"), 11))
    assert res.success, res.error
    assert (res.prompt_tokens, res.output_tokens, res.text_chunks, len(res.itl)) == (5, 4, 3, 2)
    assert 0 < res.ttft <= res.e2e and res.tpot == pytest.approx((res.e2e - res.ttft) / 3)


def test_body_without_length_and_without_usage():
    body = sse(completion("a"), completion("b", "stop"), "[DONE]")
    res = canned(b"HTTP/1.0 200 OK\r\n\r\n" + body)
    assert res.success, res.error
    assert res.output_tokens == 2 and res.prompt_tokens is None and res.input_tokens == 3


def test_error_status_with_content_length():
    body = json.dumps({"error": {"message": "bad things", "type": "invalid_request_error"}}).encode()
    res = canned(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert not res.success and res.error == "HTTP 400: bad things"


@pytest.mark.parametrize(
    "response, kind",
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(STREAM, 20)[:45], "IncompleteReadError"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + STREAM[:50], "ProtocolError"),
        (
            b"HTTP/1.1 200 OK\r\n\r\n" + sse(completion("a"), {"error": {"message": "engine died"}}, "[DONE]"),
            "error event in the stream",
        ),
        (b"garbage\r\n\r\n", "ProtocolError"),
        (b"", "ProtocolError"),
    ],
)
def test_broken_responses_are_failures(response, kind):
    res = canned(response)
    assert not res.success and error_kind(res.error) == kind, res.error


def named(*events: dict) -> bytes:
    """Server-sent events named after their `type`, as the Responses and Messages APIs send them."""
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def text_delta(text: str) -> dict:
    return {"type": "response.output_text.delta", "delta": text}


def completed(input_tokens: int, output_tokens: int) -> dict:
    usage = {"input_tokens": input_tokens, "output_tokens": output_tokens}
    return {"type": "response.completed", "response": {"status": "incomplete", "usage": usage}}


RESPONSES_STREAM = named(
    {"type": "response.created"},
    {"type": "response.output_item.added"},
    {"type": "response.reasoning_text.delta", "delta": "hm"},
    text_delta("a"),
    {"type": "response.function_call_arguments.delta", "delta": "{}"},
    {"type": "response.output_text.done", "text": "a"},
    completed(7, 4),
)
MESSAGE_START = {"type": "message_start", "message": {"usage": {"input_tokens": 5, "cache_read_input_tokens": 2}}}


def block_delta(text: str) -> dict:
    return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}


MESSAGES_STREAM = named(
    MESSAGE_START,
    {"type": "ping"},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    block_delta("a"),
    block_delta("b"),
    {"type": "content_block_stop", "index": 0},
    {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 4}},
    {"type": "message_stop"},
)


def test_request_bodies_in_each_apis_shape():
    spec = RequestSpec("a b c", 3, 4)
    args = argparse.Namespace(temperature=0.5, ignore_eos=True, extra_body={"top_k": 2})
    bodies = {e: request_body(argparse.Namespace(**vars(args), endpoint=e), "m", spec) for e in APIS}
    common = {"model": "m", "temperature": 0.5, "stream": True, "ignore_eos": True, "top_k": 2}
    usage = {"stream_options": {"include_usage": True}}
    message = [{"role": "user", "content": "a b c"}]
    assert bodies[COMPLETIONS] == {**common, **usage, "prompt": "a b c", "max_tokens": 4}
    assert bodies[CHAT] == {**common, **usage, "messages": message, "max_completion_tokens": 4, "max_tokens": 4}
    assert bodies[RESPONSES] == {**common, "input": "a b c", "max_output_tokens": 4}
    assert bodies[MESSAGES] == {**common, "messages": message, "max_tokens": 4}
    bodies[CHAT]["stream_options"]["include_usage"] = False  # each body is its own: the table stays as it was
    assert (
        request_body(argparse.Namespace(**vars(args), endpoint=CHAT), "m", spec)["stream_options"]
        == usage["stream_options"]
    )


@pytest.mark.parametrize(
    "endpoint, stream, counts",
    [
        (RESPONSES, RESPONSES_STREAM, (7, 4, 3)),  # reasoning, text and arguments deltas all carry output
        (MESSAGES, MESSAGES_STREAM, (7, 4, 2)),  # input tokens: read from the cache or not, all of them
    ],
)
def test_responses_and_messages_streams_are_timed_by_their_events(endpoint, stream, counts):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    res = canned(head + chunked(stream, 13), endpoint=endpoint)
    assert res.success, res.error
    assert (res.prompt_tokens, res.output_tokens, res.text_chunks) == counts
    assert len(res.itl) == counts[2] - 1 and 0 < res.ttft <= res.e2e


@pytest.mark.parametrize(
    "endpoint, stream, kind",
    [
        (RESPONSES, named(text_delta("a"), {"type": "error", "code": "x", "message": "engine died"}), "error event"),
        (
            RESPONSES,
            named(text_delta("a"), {"type": "response.failed", "response": {"error": {"message": "no"}}}),
            "response.failed event",
        ),
        (RESPONSES, named(text_delta("a")), "ProtocolError"),  # no response.completed
        (MESSAGES, named(MESSAGE_START, {"type": "error", "error": {"message": "overloaded"}}), "error event"),
        (MESSAGES, named(MESSAGE_START, block_delta("a"), {"type": "message_stop"}), "ProtocolError"),  # no delta
    ],
)
def test_broken_responses_and_messages_streams_are_failures(endpoint, stream, kind):
    res = canned(b"HTTP/1.1 200 OK\r\n\r\n" + stream, endpoint=endpoint)
    assert not res.success and error_kind(res.error).startswith(kind), res.error


def test_timeout():
    start = time.monotonic()
    res = canned(b"HTTP/1.1 200 OK\r\n\r\n" + STREAM, hang=True)
    assert not res.success and error_kind(res.error) == "timeout"
    assert time.monotonic() - start < 5


# ---- workload and statistics ----------------------------------------------------------------------------


def workload_args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_bench_args(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_workload_is_seeded_and_in_range():
    args = workload_args(
        num_prompts=50, random_input_len=100, random_output_len=20, random_range_ratio=0.5, vocab_size=300
    )
    specs = make_requests(args)
    assert [s.prompt for s in specs] == [s.prompt for s in make_requests(args)]
    assert all(50 <= s.prompt_len == len(s.prompt) <= 150 and 10 <= s.output_len <= 30 for s in specs)
    assert all(100 <= t < 300 for s in specs for t in s.prompt)
    args.dataset = "fixed"
    assert {(s.prompt_len, s.output_len) for s in make_requests(args)} == {(100, 20)}
    times = arrival_times(2000, 50.0, 0)
    assert times == sorted(times) and times[0] == 0
    assert times[-1] / 1999 == pytest.approx(1 / 50, rel=0.1)
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]


def test_nano_vllm_seed_shifts_ids_not_lengths():
    args = workload_args(dataset="nano-vllm", num_prompts=8, vocab_size=10000)
    exact, shifted = make_requests(args), make_requests(workload_args(**{**vars(args), "seed": 3}))
    prompts, max_tokens = nano_vllm_requests(8, vocab_size=10000)
    assert [s.prompt for s in exact] == prompts and [s.output_len for s in exact] == max_tokens
    assert [s.output_len for s in shifted] == max_tokens
    assert [s.prompt for s in shifted] == [[(t + 3) % 10000 for t in p] for p in prompts]


def test_flags_a_script_sets_itself_can_be_left_out():
    p = argparse.ArgumentParser()
    add_serve_bench_args(p, omit=("--request-rate", "--random-input-len"))
    flags = {s for a in p._actions for s in a.option_strings}
    assert not flags & {"--request-rate", "--random-input-len", "--input-len"} and "--output-len" in flags
    with pytest.raises(SystemExit):
        p.parse_args(["--request-rate", "3"])


def test_percentiles_match_numpy():
    np = pytest.importorskip("numpy")
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.45]
    d = distribution(values)
    ms = np.array(values) * 1e3
    assert d["median"] == pytest.approx(np.percentile(ms, 50), abs=1e-3)
    assert d["p90"] == pytest.approx(np.percentile(ms, 90), abs=1e-3)
    assert d["p99"] == pytest.approx(np.percentile(ms, 99), abs=1e-3)
    assert d["std"] == pytest.approx(ms.std(), abs=1e-3)
    assert distribution([]) == dict.fromkeys(STATS)


def test_progress_chunks_count_as_output_but_role_and_empty_final_chunks_do_not():
    assert carries_output({"text": "", "finish_reason": None}, chat=False)
    assert not carries_output({"text": "", "finish_reason": "length"}, chat=False)
    assert carries_output({"text": "x", "finish_reason": "length"}, chat=False)
    assert not carries_output({"delta": {"role": "assistant", "content": ""}, "finish_reason": None}, chat=True)
    assert carries_output({"delta": {"content": ""}, "finish_reason": None}, chat=True)
    assert carries_output({"delta": {"reasoning_content": "hm"}, "finish_reason": None}, chat=True)
    assert not carries_output({"delta": {}, "finish_reason": "stop"}, chat=True)
