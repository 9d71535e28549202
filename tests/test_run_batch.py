"""`ember run-batch` and `LLM.run_batch`: OpenAI batch files through the engine (in process or over HTTP),
against a real `ember serve` for the expected answers; bad lines, retries, and resume after `kill -9`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import DEVICE, make_checkpoint
from test_server_robustness import _start_serve

from ember.batch.local import EngineTarget, settings_for
from ember.batch.runner import BatchOptions, BatchRunner, Reply
from ember.config import EngineArgs
from ember.frontend.async_llm import AsyncLLM
from ember.server.state import ServerState

MODEL = "tiny"
ENGINE_FLAGS = ["--served-model-name", MODEL, "--kv-cache-memory", "0.05", "--dtype", "float32", "--device", DEVICE]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(text: str, max_tokens: int = 8) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def completion_body(text: str, max_tokens: int = 8) -> dict:
    return {
        "model": MODEL,
        "prompt": text,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
    }


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


# Good lines of both kinds, and one of each way a line can be wrong: its number in the file is its key.
GOOD = {
    "chat-0": (CHAT, chat_body("Paris is the capital of")),
    "chat-1": (CHAT, {**chat_body("def add(a, b):"), "n": 2, "temperature": 0.8, "seed": 7}),
    "cmpl-0": (COMPLETIONS, completion_body("The quick brown fox")),
    "cmpl-1": (COMPLETIONS, {**completion_body("Large language models"), "stop": [" "]}),
}
BAD_LINES = [  # (line text, custom_id, error code, status of the server's own answer or None)
    ("{not json", None, "invalid_json", None),
    (json.dumps({"method": "POST", "url": CHAT, "body": chat_body("x")}), None, "missing_custom_id", None),
    (line("bad-url", "/v1/embeddings", {"input": "x"}), "bad-url", "invalid_url", None),
    (
        json.dumps({"custom_id": "bad-method", "method": "GET", "url": CHAT, "body": {}}),
        "bad-method",
        "invalid_method",
        None,
    ),
    (line("stream", CHAT, {**chat_body("x"), "stream": True}), "stream", "invalid_body", None),
    (line("chat-0", CHAT, chat_body("a duplicate")), "chat-0", "duplicate_custom_id", None),
    (line("no-messages", CHAT, {"model": MODEL, "max_tokens": 4}), "no-messages", "invalid_request_error", 400),
    (
        line("bad-range", COMPLETIONS, {**completion_body("x"), "temperature": -1}),
        "bad-range",
        "invalid_request_error",
        400,
    ),
    (
        line("other-model", COMPLETIONS, {**completion_body("x"), "model": "gpt-4o"}),
        "other-model",
        "model_not_found",
        404,
    ),
]


def mixed_lines() -> list[str]:
    good = [line(cid, url, body) for cid, (url, body) in GOOD.items()]
    return good[:2] + [text for text, *_ in BAD_LINES] + good[2:]


def bad_line_numbers() -> dict[int, tuple]:
    return {i + 3: bad[1:] for i, bad in enumerate(BAD_LINES)}


def read_records(path: Path) -> list[dict]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def answer_fields(body: dict) -> dict:
    """What must match between two answers to one body (ids and timestamps differ)."""
    return {"choices": body["choices"], "usage": body["usage"], "model": body["model"], "object": body["object"]}


def assert_same(a, b, where: str = "") -> None:
    """Equal, except logprobs within float32 noise: requests batched differently round differently."""
    if isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, abs=1e-4), where
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def run_batch_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ember.cli", "run-batch", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("batch") / "llama", "llama")


@pytest.fixture(scope="module")
def server(model_dir):
    proc, url = _start_serve(model_dir, *ENGINE_FLAGS[:2], *ENGINE_FLAGS[4:])
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


@pytest.fixture(scope="module")
def expected(server) -> dict[str, dict]:
    """Each good line's body answered by the server over HTTP."""
    answers = {}
    for cid, (url, body) in GOOD.items():
        r = httpx.post(server + url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        answers[cid] = answer_fields(r.json())
    return answers


def check_mixed_output(records: list[dict], expected: dict[str, dict], stderr: str | None = None) -> None:
    assert len(records) == len(GOOD) + len(BAD_LINES)
    ok = {r["custom_id"]: r for r in records if r["error"] is None}
    assert set(ok) == set(GOOD)
    for cid, record in ok.items():
        assert record["response"]["status_code"] == 200
        assert record["response"]["request_id"] == record["response"]["body"]["id"]
        assert_same(answer_fields(record["response"]["body"]), expected[cid], cid)
    failed = {r["error"]["line"]: r for r in records if r["error"] is not None}
    assert set(failed) == set(bad_line_numbers())
    for number, (custom_id, code, status) in bad_line_numbers().items():
        record = failed[number]
        assert (record["custom_id"], record["error"]["code"]) == (custom_id, code), record
        assert stderr is None or f"line {number}" in stderr
        if status is None:  # never reached the server
            assert record["response"] is None
        else:  # the server's own error answer, as a POST gets it
            assert record["response"]["status_code"] == status
            assert record["response"]["body"]["error"]["message"] == record["error"]["message"]


def test_cli_in_process_matches_server_and_reports_bad_lines(model_dir, tmp_path, expected):
    (tmp_path / "in.jsonl").write_text("\n".join(mixed_lines()) + "\n\n")
    out = tmp_path / "out.jsonl"
    done = run_batch_cli(
        "-i", str(tmp_path / "in.jsonl"), "-o", str(out), str(model_dir), *ENGINE_FLAGS, "--no-progress"
    )
    assert done.returncode == 0, done.stderr
    check_mixed_output(read_records(out), expected, done.stderr)
    assert "4 succeeded, 9 failed, 0 already done" in done.stderr


def test_cli_url_mode_matches_server_and_resumes(server, tmp_path, expected):
    (tmp_path / "in.jsonl").write_text("\n".join(mixed_lines()) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--url", server, "--max-concurrency", "2"]
    done = run_batch_cli(*args)
    assert done.returncode == 0, done.stderr
    check_mixed_output(read_records(out), expected, done.stderr)
    # A rerun answers nothing twice, even the bad lines (keyed by line number).
    again = run_batch_cli(*args)
    assert again.returncode == 0, again.stderr
    assert "0 succeeded, 0 failed, 13 already done" in again.stderr
    assert len(read_records(out)) == len(GOOD) + len(BAD_LINES)


def test_cli_url_mode_retries_connection_failures_then_writes_errors(tmp_path):
    (tmp_path / "in.jsonl").write_text(line("a", CHAT, chat_body("x")) + "\n")
    out = tmp_path / "out.jsonl"
    started = time.monotonic()
    done = run_batch_cli(
        "-i",
        str(tmp_path / "in.jsonl"),
        "-o",
        str(out),
        "--url",
        "http://127.0.0.1:9",
        "--max-retries",
        "2",
        "--retry-delay",
        "0.2",
        "--no-progress",
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started >= 0.2 + 0.4  # two backoff waits before the final error
    [record] = read_records(out)
    assert record["response"] is None
    assert record["error"]["code"] == "connection_error" and record["error"]["line"] == 1
    assert "2 retries" in done.stderr


def _job_with_output(
    model_dir, tmp_path, lines: list[str], concurrency: int, written: int, **popen
) -> tuple[list[str], Path, subprocess.Popen]:
    """Start `ember run-batch` on `lines` in a subprocess and return (its command, the output path, the
    process) once it has written `written` result lines."""
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "ember.cli",
        "run-batch",
        "-i",
        str(tmp_path / "in.jsonl"),
        "-o",
        str(out),
        str(model_dir),
        *ENGINE_FLAGS,
        "--max-concurrency",
        str(concurrency),
        "--no-progress",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **popen)
    deadline = time.monotonic() + 180
    while not (out.exists() and out.read_text().count("\n") >= written):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no output before the deadline"
        time.sleep(0.02)
    return cmd, out, proc


def test_kill_9_mid_run_then_rerun_answers_every_line_once(model_dir, tmp_path):
    ids = [f"req-{i:03d}" for i in range(12)]
    lines = [
        line(
            cid,
            CHAT if i % 2 else COMPLETIONS,
            (chat_body if i % 2 else completion_body)(f"request {i}", max_tokens=32),
        )
        for i, cid in enumerate(ids)
    ]
    cmd, out, proc = _job_with_output(model_dir, tmp_path, lines, concurrency=2, written=2, start_new_session=True)
    os.killpg(proc.pid, signal.SIGKILL)  # the job and its engine core process, as the OOM killer would
    proc.wait(30)
    first = read_records(out)
    assert 2 <= len(first) < len(ids)
    with open(out, "a") as f:  # as if the kill had landed inside a write
        f.write('{"id": "batch_req_x", "custom_id": "req-011", "response": {"status_co')
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(ids) - len(first)} succeeded, 0 failed, {len(first)} already done" in rerun.stderr
    records = read_records(out)
    assert sorted(r["custom_id"] for r in records) == ids
    assert all(r["error"] is None for r in records)
    assert records[: len(first)] == first  # what the killed run wrote is kept as it was


class Flaky:
    """A test seam around the real target: the first `fail[user]` attempts of a body whose `user` field
    is listed get `reply` (or, for a timeout, wait past the runner's timeout) instead of an answer."""

    def __init__(self, target, fail: dict[str, tuple[int, Reply | None]]) -> None:
        self.target = target
        self.fail = fail
        self.attempts: dict[str, list[float]] = {}

    async def __call__(self, url: str, body: dict) -> Reply:
        user = body.get("user", "")
        self.attempts.setdefault(user, []).append(time.monotonic())
        failures, reply = self.fail.get(user, (0, None))
        if len(self.attempts[user]) <= failures:
            if reply is None:
                await asyncio.sleep(60)
            return reply
        return await self.target(url, body)


def test_retries_with_backoff_then_error_shape(model_dir, tmp_path):
    unavailable = Reply(
        503, {"error": {"message": "busy", "type": "service_unavailable", "code": "service_unavailable"}}
    )
    bad = Reply(400, {"error": {"message": "nope", "type": "invalid_request_error", "code": None}})
    body = chat_body("The quick brown fox")
    lines = [line(user, CHAT, {**body, "user": user}) for user in ("plain", "twice", "always", "final", "slow")]
    args = EngineArgs(
        model=str(model_dir), kv_cache_memory=0.05, device=DEVICE, dtype="float32", served_model_name=MODEL
    )

    async def run() -> tuple[Flaky, object]:
        engine = AsyncLLM(args, served_model_name=MODEL)
        try:
            flaky = Flaky(
                EngineTarget(ServerState(settings_for(args), engine)),
                {"twice": (2, unavailable), "always": (99, unavailable), "final": (99, bad), "slow": (1, None)},
            )
            options = BatchOptions(max_concurrency=4, max_retries=2, retry_delay=0.1, request_timeout=3, progress=False)
            summary = await BatchRunner(flaky, tmp_path / "out.jsonl", options).run(lines)
            return flaky, summary
        finally:
            await engine.shutdown(timeout=0)

    flaky, summary = asyncio.run(run())
    records = {r["custom_id"]: r for r in read_records(tmp_path / "out.jsonl")}
    assert [len(flaky.attempts[u]) for u in ("plain", "twice", "always", "final", "slow")] == [1, 3, 3, 1, 2]
    gaps = [b - a for a, b in zip(flaky.attempts["always"], flaky.attempts["always"][1:])]
    assert 0.1 <= gaps[0] < 0.2 and 0.2 <= gaps[1] < 0.35  # retry_delay, then doubled (jitter up to 1.25x)
    plain = records["plain"]["response"]["body"]
    for user in ("twice", "slow"):  # retried to success: the same answer as a first-time success
        assert records[user]["error"] is None
        assert_same(answer_fields(records[user]["response"]["body"]), answer_fields(plain), user)
    assert records["always"]["response"]["status_code"] == 503
    assert records["always"]["error"] == {"code": "service_unavailable", "message": "busy", "line": 3}
    assert records["final"]["response"]["status_code"] == 400  # a request error is not retried
    assert records["final"]["error"] == {"code": "invalid_request_error", "message": "nope", "line": 4}
    assert (summary.succeeded, summary.failed, summary.retries) == (3, 2, 2 + 2 + 1)


def test_llm_run_batch_shares_the_engine_and_resumes(model_dir, tmp_path, expected):
    from ember import LLM, SamplingParams

    llm = LLM(str(model_dir), kv_cache_memory=0.05, device=DEVICE, dtype="float32", served_model_name=MODEL)
    try:
        requests = [json.loads(text) for text in mixed_lines()[:2]]
        out = tmp_path / "out.jsonl"
        first = llm.run_batch(requests, out, use_tqdm=False)
        assert (first.succeeded, first.failed) == (2, 0)
        # The LLM still generates on its core afterwards, and a rerun with more lines runs only the new ones.
        assert len(llm.generate("Paris", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4
        (tmp_path / "in.jsonl").write_text("\n".join(mixed_lines()) + "\n")
        second = llm.run_batch(tmp_path / "in.jsonl", out, use_tqdm=False)
        assert (second.skipped, second.succeeded, second.failed) == (2, 2, 9)
        check_mixed_output(read_records(out), expected)
    finally:
        llm.llm_engine.shutdown()


def test_engine_death_stops_the_job_and_a_rerun_finishes_it(model_dir, tmp_path):
    ids = [f"req-{i:03d}" for i in range(8)]
    lines = [line(cid, COMPLETIONS, completion_body(cid, max_tokens=32)) for cid in ids]
    cmd, out, proc = _job_with_output(model_dir, tmp_path, lines, concurrency=1, written=1, text=True)
    [core] = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()  # the engine core process
    os.kill(int(core), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert "rerun the same command" in stderr
    first = read_records(out)
    assert 1 <= len(first) < len(ids) and all(r["error"] is None for r in first)  # no error written for the rest
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(r["custom_id"] for r in read_records(out)) == ids
