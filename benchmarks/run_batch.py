"""`ember run-batch` against `ember bench serve` at the same concurrency, and its kill -9 + rerun check.

The target (issue 17, CPU, default model, 1,000 chat requests): `ember run-batch` throughput within
10% of `ember bench serve`'s at the same concurrency, and after `kill -9` mid-run, a rerun leaves
every custom_id exactly once in the output. One run measures, on the same `--num-requests` chat
requests (`ember bench serve`'s fixed dataset: `--input-len` random words, `--output-len` greedy
tokens with `ignore_eos`):

1. `bench-serve`: `ember serve` (spawned here), loaded by `ember bench serve` with `--max-concurrency`
   streams;
2. `run-batch --url`: the same server, its prefix cache reset, driven by `ember run-batch --url`;
3. `run-batch`: `ember run-batch` with the engine in its own process (the server is stopped first);
4. the kill check: `ember run-batch` again into a new output file, `kill -9` (the job and its engine
   core) once a third of the lines are written, then the same command again; the output must hold
   every custom_id once, all successes.

Throughput is output tokens over the time from the first request to the last answer, as each tool
reports it (model loading excluded in all three).

    python benchmarks/run_batch.py                                 # the target's run (minutes on CPU)
    python benchmarks/run_batch.py --num-requests 20 --output-len 4   # a quick check that it works
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, free_port, machine_info, server_command, stop, today, wait_ready, write_json
from benchmarks.throughput import model_short_name
from ember.bench import serve as bench_serve
from ember.bench.flags import add_serve_bench_args
from ember.bench.workloads import make_requests, request_body
from ember.http_client import CHAT, http_request

_SUMMARY = re.compile(
    r"(\d+) succeeded, (\d+) failed, (\d+) already done; (\d+) retries; "
    r"(\d+) output tokens in ([\d.]+)s"
)
TARGET_RATIO = 0.9


def bench_args(args: argparse.Namespace, base_url: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_bench_args(parser)
    return parser.parse_args(
        [
            "--base-url",
            base_url,
            "--endpoint",
            CHAT,
            "--dataset",
            "fixed",
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--num-prompts",
            str(args.num_requests),
            "--max-concurrency",
            str(args.max_concurrency),
            "--seed",
            str(args.seed),
            "--temperature",
            "0",
            "--model",
            args.served_model_name,
            "--disable-tqdm",
        ]
    )


def write_batch_file(path: str, bargs: argparse.Namespace) -> None:
    """The bench's requests as batch lines: the same bodies, not streamed."""
    with open(path, "w", encoding="utf-8") as f:
        for i, spec in enumerate(make_requests(bargs)):
            body = request_body(bargs, bargs.model, spec)
            for key in ("stream", "stream_options"):
                body.pop(key)
            f.write(json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": CHAT, "body": body}) + "\n")


def ember_command(args: argparse.Namespace, *rest: str) -> list[str]:
    """`ember <rest> [model] --served-model-name ... <--ember-args>`."""
    serve = server_command(None, "127.0.0.1", 0, [])
    base = serve[: serve.index("serve")]  # the `ember` console script, or `python -m ember.cli`
    return [
        *base,
        *rest,
        *([args.model] if args.model else []),
        "--served-model-name",
        args.served_model_name,
        *shlex.split(args.ember_args),
    ]


def run_batch_command(args: argparse.Namespace, input_path: str, output_path: str, *extra: str) -> list[str]:
    return ember_command(
        args,
        "run-batch",
        "-i",
        input_path,
        "-o",
        output_path,
        "--max-concurrency",
        str(args.max_concurrency),
        "--no-progress",
        *extra,
    )


def summary_of(stderr: str) -> dict[str, Any]:
    match = _SUMMARY.search(stderr)
    if match is None:
        raise RuntimeError(f"no summary line in ember run-batch's output:\n{stderr[-2000:]}")
    succeeded, failed, skipped, retries, tokens = (int(g) for g in match.groups()[:5])
    seconds = float(match.group(6))
    return {
        "succeeded": succeeded,
        "failed": failed,
        "skipped": skipped,
        "retries": retries,
        "output_tokens": tokens,
        "duration_s": seconds,
        "output_throughput": tokens / max(seconds, 1e-9),
    }


def run_and_check(cmd: list[str], timeout: float) -> dict[str, Any]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return {**summary_of(done.stderr), "command": cmd}


def server_runs(args: argparse.Namespace, batch_path: str, workdir: str) -> dict[str, Any]:
    """`ember bench serve`, then `ember run-batch --url`, on one fresh server."""
    port = free_port("127.0.0.1")
    base_url = f"http://127.0.0.1:{port}"
    cmd = ember_command(args, "serve", "--port", str(port))
    with tempfile.TemporaryFile("w+", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            try:
                wait_ready(proc, "127.0.0.1", port, time.perf_counter(), args.timeout)
            except RuntimeError as e:
                log.seek(0)
                raise RuntimeError(f"{e}:\n{log.read()[-2000:]}") from None
            doc = asyncio.run(bench_serve.benchmark(bench_args(args, base_url)))
            bench = {
                k: doc["results"][k]
                for k in (
                    "completed",
                    "failed",
                    "duration_s",
                    "total_output_tokens",
                    "output_throughput",
                    "max_concurrency_observed",
                )
            }
            asyncio.run(http_request("POST", base_url + "/reset_prefix_cache"))
            url_run = run_and_check(
                run_batch_command(args, batch_path, os.path.join(workdir, "url.jsonl"), "--url", base_url), args.timeout
            )
        finally:
            stop(proc)
    return {"server_command": cmd, "bench_serve": bench, "run_batch_url": url_run}


def kill_check(args: argparse.Namespace, batch_path: str, workdir: str) -> dict[str, Any]:
    output = os.path.join(workdir, "killed.jsonl")
    cmd = run_batch_command(args, batch_path, output)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    at = max(1, args.num_requests // 3)
    deadline = time.monotonic() + args.timeout
    while _lines(output) < at:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"the job ended (status {proc.returncode}) or timed out before {at} lines")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    written = _lines(output)
    rerun = run_and_check(cmd, args.timeout)
    with open(output, encoding="utf-8") as f:
        records = [json.loads(text) for text in f]
    counts = Counter(r["custom_id"] for r in records)
    expected = {f"request-{i}" for i in range(args.num_requests)}
    ok = set(counts) == expected and max(counts.values()) == 1 and all(r["error"] is None for r in records)
    return {
        "lines_before_kill": written,
        "rerun": rerun,
        "records": len(records),
        "every_custom_id_once": ok,
        "failed_records": sum(r["error"] is not None for r in records),
    }


def _lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def print_table(results: dict[str, Any]) -> None:
    bench = results["bench_serve"]
    rows = [
        ("ember bench serve", bench["completed"], bench["failed"], bench["duration_s"], bench["output_throughput"]),
        *(
            (name, r["succeeded"], r["failed"], r["duration_s"], r["output_throughput"])
            for name, r in (
                ("ember run-batch --url", results["run_batch_url"]),
                ("ember run-batch", results["run_batch"]),
            )
        ),
    ]
    print(f"{'':24}{'ok':>7}{'failed':>8}{'seconds':>10}{'out tok/s':>11}{'vs bench':>10}")
    for name, ok, failed, seconds, rate in rows:
        print(f"{name:24}{ok:>7}{failed:>8}{seconds:>10.1f}{rate:>11.1f}{rate / bench['output_throughput']:>10.2f}")
    kill = results["kill_check"]
    print(
        f"kill -9 after {kill['lines_before_kill']} lines, rerun: {kill['records']} records, every custom_id "
        f"exactly once and succeeded: {kill['every_custom_id_once']}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model for both (default: Ember's default model)")
    p.add_argument("--served-model-name", default="bench")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=32, help="words of each chat message")
    p.add_argument("--output-len", type=int, default=16, help="greedy tokens of each answer (ignore_eos)")
    p.add_argument("--max-concurrency", type=int, default=64, help="requests in flight, for both tools")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ember-args",
        default="",
        help="more engine flags for `ember serve` and `ember run-batch`: --ember-args='--kv-cache-memory 1'",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one step may take")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/run-batch-<model>-<date>.json)")
    args = p.parse_args(argv)
    if min(args.num_requests, args.input_len, args.output_len, args.max_concurrency) < 1:
        p.error("--num-requests, lengths and --max-concurrency must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="ember-run-batch-") as workdir:
        batch_path = os.path.join(workdir, "requests.jsonl")
        write_batch_file(batch_path, bench_args(args, "http://unused"))
        print(
            f"{args.num_requests} chat requests, {args.input_len} words in, {args.output_len} tokens out, "
            f"{args.max_concurrency} in flight",
            flush=True,
        )
        results = server_runs(args, batch_path, workdir)
        results["run_batch"] = run_and_check(
            run_batch_command(args, batch_path, os.path.join(workdir, "local.jsonl")), args.timeout
        )
        results["kill_check"] = kill_check(args, batch_path, workdir)
    ratio = results["run_batch"]["output_throughput"] / results["bench_serve"]["output_throughput"]
    results["run_batch_vs_bench_serve"] = round(ratio, 4)
    results["target_met"] = ratio >= TARGET_RATIO and results["kill_check"]["every_custom_id_once"]
    print_table(results)
    out = args.out or os.path.join(RESULTS_DIR, f"run-batch-{model_short_name(args.model)}-{today()}.json")
    write_json(
        out,
        {
            "benchmark": "run-batch",
            "date": today(),
            "machine": machine,
            "command": sys.argv,
            "config": vars(args),
            "results": results,
        },
    )
    print(f"wrote {out}")
    return 0 if results["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
