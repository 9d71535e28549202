"""Single-stream speed of the same engine three ways: `LLM` in-process, `LLM(engine_process=True)`, `ember serve`.

What a server costs one user on top of the library: the same `--num-requests` prompts of
`--input-len` random token ids, `--output-len` greedy tokens each (`ignore_eos`), one request at a
time, through
- `library`: `LLM(engine_process=False)`, the engine core in this thread;
- `library-engine-process`: `LLM(engine_process=True)`, the core in its own process behind ZMQ;
- `server`: `ember serve` spawned by this script (its default: the core in its own process), driven
  over HTTP by `ember bench serve`'s client, streaming.
The design target (CPU, default model): server and library single-stream tok/s within 5%.

    python benchmarks/server_vs_library.py --kv-cache-memory 1
    python benchmarks/server_vs_library.py --kv-cache-memory 0.5 --num-requests 2 --input-len 32 --output-len 16 \\
        --repeats 2                                                                               # quick

All three engines stay up for the whole run. Each gets one warm-up request, then `--repeats` rounds
run every path on that round's prompts (seed `--seed + 1 + round`: no prompt repeats, so no prefix
cache hit), the paths taking turns (round r starts at path r), so that a change in the machine's load
hits them alike; `loadavg` is recorded before each round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, ember_server, machine_info, today, write_json
from benchmarks.cpu import bench_args
from benchmarks.latency import measure
from benchmarks.throughput import model_short_name
from ember import LLM
from ember.bench import serve as bench_serve
from ember.bench.machine import load_average
from ember.bench.workloads import make_requests

PATHS = ("library", "library-engine-process", "server")
# One measured request: output tokens, seconds from sending to the last token, seconds to the first token.
Request = dict[str, float]
Runner = Callable[[int, int], list[Request]]  # (number of requests, seed) -> one record per request


def prompts(args: argparse.Namespace, n: int, seed: int) -> list[list[int]]:
    """`ember bench serve`'s fixed-length random prompts, so that the library paths get the server's exact ids."""
    return [s.prompt for s in make_requests(bench_args(args, "http://unused", n, 1, args.output_len, seed))]


def library_runner(args: argparse.Namespace, llm: LLM) -> Runner:
    """Each request through `llm.llm_engine.step()`, the loop `LLM.generate` runs, with per-step outputs so that
    the first token's time is known (benchmarks/latency.py's `measure`)."""

    def run(n: int, seed: int) -> list[Request]:
        records = []
        for prompt in prompts(args, n, seed):
            start = time.perf_counter()
            ttft, _ = measure(llm, prompt, args.output_len)
            records.append({"output_tokens": args.output_len, "e2e_s": time.perf_counter() - start, "ttft_s": ttft})
        return records

    return run


def server_runner(args: argparse.Namespace, base_url: str) -> Runner:
    """`ember bench serve` with one request in flight; a failed request ends the run (nothing to compare)."""

    def run(n: int, seed: int) -> list[Request]:
        doc = asyncio.run(bench_serve.benchmark(bench_args(args, base_url, n, 1, args.output_len, seed)))
        if doc["results"]["failed"]:
            raise RuntimeError(f"server: {doc['results']['failed']} of {n} requests failed: {doc['results']['errors']}")
        return [
            {"output_tokens": r["output_tokens"], "e2e_s": r["e2el_ms"] / 1e3, "ttft_s": r["ttft_ms"] / 1e3}
            for r in doc["requests"]
        ]

    return run


def engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings every path shares (the server gets them as flags)."""
    return {"device": args.device, "kv_cache_memory": args.kv_cache_memory}


def server_flags(args: argparse.Namespace) -> list[str]:
    """`ember serve`'s flags: the shared settings, then `--server-args`."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_flags(args).items() if v is not None]
    return [*flags, *shlex.split(args.server_args)]


def per_request(record: Request) -> dict[str, float | None]:
    """Single-stream output tok/s (output tokens / request time) and decode tok/s (the tokens after the first
    over the time after it: 1 / TPOT) of one request."""
    decode_s = record["e2e_s"] - record["ttft_s"]
    return {
        "tok_s": round(record["output_tokens"] / record["e2e_s"], 3),
        "decode_tok_s": round((record["output_tokens"] - 1) / decode_s, 3) if decode_s > 0 else None,
        "ttft_ms": round(record["ttft_s"] * 1e3, 3),
        "e2e_ms": round(record["e2e_s"] * 1e3, 3),
        "output_tokens": record["output_tokens"],
    }


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def run_rounds(args: argparse.Namespace, runners: dict[str, Runner]) -> list[dict[str, Any]]:
    """One warm-up request per path, then the rounds, each path's turn rotating."""
    for path, runner in runners.items():
        print(f"warm-up: {path}", flush=True)
        runner(1, args.seed)
    rounds = []
    for r in range(args.repeats):
        order = [PATHS[(r + i) % len(PATHS)] for i in range(len(PATHS))]
        record: dict[str, Any] = {
            "round": r,
            "loadavg_before": load_average(),
            "seed": args.seed + 1 + r,
            "order": order,
            "requests": {},
        }
        for path in order:
            record["requests"][path] = [per_request(q) for q in runners[path](args.num_requests, args.seed + 1 + r)]
            print(
                f"round {r + 1}/{args.repeats} {path}: median "
                f"{median([q['tok_s'] for q in record['requests'][path]])} tok/s",
                flush=True,
            )
        rounds.append(record)
    return rounds


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over every request of every round, per path; the per-round medians show the spread."""
    paths = {}
    for path in PATHS:
        requests = [q for r in rounds for q in r["requests"][path]]
        paths[path] = {key: median([q[key] for q in requests]) for key in ("tok_s", "decode_tok_s", "ttft_ms")}
        paths[path]["tok_s_per_round"] = [median([q["tok_s"] for q in r["requests"][path]]) for r in rounds]

    def ratio(a: str, b: str) -> float | None:
        x, y = paths[a]["tok_s"], paths[b]["tok_s"]
        return round(x / y, 4) if x and y else None

    return {
        "paths": paths,
        "server_over_library": ratio("server", "library"),
        "engine_process_over_library": ratio("library-engine-process", "library"),
        "server_over_engine_process": ratio("server", "library-engine-process"),
    }


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'path':<24}{'1-stream tok/s':>16}{'decode tok/s':>14}{'TTFT ms':>10}   per round")
    for path, p in summary["paths"].items():
        cells = ("n/a" if v is None else f"{v:.2f}" for v in (p["tok_s"], p["decode_tok_s"], p["ttft_ms"]))
        print(
            f"{path:<24}"
            + "".join(f"{c:>{w}}" for c, w in zip(cells, (16, 14, 10)))
            + "   "
            + " ".join(f"{v:.2f}" for v in p["tok_s_per_round"])
        )
    print(
        f"server / library: {summary['server_over_library']} (target: within 5%); library-engine-process / "
        f"library: {summary['engine_process_over_library']}; server / library-engine-process: "
        f"{summary['server_over_engine_process']}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="what every path loads (default: the default model)")
    p.add_argument("--device", default=None, help="cpu, cuda (default: the engine's choice)")
    p.add_argument("--kv-cache-memory", type=float, default=None, help="KV cache GiB of every engine (CPU)")
    p.add_argument("--server-args", default="", help="more `ember serve` flags, one string: --server-args='...'")
    p.add_argument("--num-requests", type=int, default=5, help="requests per path and round, one at a time")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random token ids)")
    p.add_argument("--output-len", type=int, default=128, help="greedy tokens per request (ignore_eos)")
    p.add_argument("--repeats", type=int, default=3, help="rounds, the paths taking turns in each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the server may take to become ready")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one server request may take")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/server-vs-library-<model>-<device>-<date>.json)",
    )
    args = p.parse_args(argv)
    if min(args.num_requests, args.input_len, args.repeats) < 1 or args.output_len < 2:
        p.error("--num-requests, --input-len and --repeats must be >= 1, --output-len >= 2 (decode needs 2 tokens)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()
    with contextlib.ExitStack() as stack:
        libraries = {}
        for path, engine_process in (("library", False), ("library-engine-process", True)):
            llm = LLM(
                args.model,
                engine_process=engine_process,
                **{k: v for k, v in engine_flags(args).items() if v is not None},
            )
            stack.callback(llm.llm_engine.shutdown)
            libraries[path] = llm
        base_url = stack.enter_context(ember_server(args.model, server_flags(args), args.timeout)).url
        ready = libraries["library"].llm_engine.ready
        runners = {path: library_runner(args, llm) for path, llm in libraries.items()}
        runners["server"] = server_runner(args, base_url)
        rounds = run_rounds(args, runners)
    summary = summarize(rounds)
    print_table(summary)
    device = ready.device.split(":")[0]
    out = args.out or os.path.join(
        RESULTS_DIR, f"server-vs-library-{model_short_name(args.model)}-{device}-{today()}.json"
    )
    resolved = {
        "device": ready.device,
        "dtype": ready.dtype,
        "quantization": ready.quantization,
        "async_scheduling": ready.async_scheduling,
        "kv_cache_tokens": ready.kv_capacity_tokens,
    }
    write_json(
        out,
        {
            "benchmark": "server-vs-library",
            "date": today(),
            "machine": machine,
            "command": sys.argv,
            "config": {**vars(args), "resolved": resolved},
            "results": {**summary, "rounds": rounds},
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
