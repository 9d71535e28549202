"""Serving throughput through the agent APIs: `/v1/responses` and `/v1/messages` against `/v1/chat/completions`.

The target (issue 28, CPU, default model, 16 concurrent, same prompts and lengths): output tok/s
through OpenAI's Responses API and Anthropic's Messages API each at least 0.95x that of chat
completions. All three render the same conversation through the same chat path below HTTP
(ember/server/conversation.py), so what this measures is what each API's request parsing, event
writing and bookkeeping (the Responses API stores every response, as OpenAI's does by default) cost
on top of chat's.

One run starts `ember serve` (the default model on `--device cpu`), then sends `--num-prompts`
streaming requests, `--max-concurrency` in flight, through each API with `ember bench serve`'s client
(`ember.bench.serve.benchmark`, in-process): its fixed dataset, one user message of `--input-len`
random words and `--output-len` greedy tokens with `ignore_eos`, so every API generates the same
tokens from the same prompts, each in its own request shape (`--endpoint`). Each API first gets a
warm-up run; then `--rounds` rounds run every API once, on that round's prompts (seed
`--seed + 1 + round`, the same for all three), the order rotating (round r starts at API r) so that a
drift in the machine's load hits them alike. The server's prefix cache is reset (`POST
/reset_prefix_cache`) before every run: no run finds another's prompts cached. `loadavg` is recorded
before each round; a CPU number from a busy machine is not comparable.

    python benchmarks/agent_apis.py                                   # the target's run (minutes on CPU)
    python benchmarks/agent_apis.py --num-prompts 8 --rounds 1 --output-len 16     # a quick check that it works
    python benchmarks/agent_apis.py --server-args='--kv-cache-memory 1'

The table shows each API's output tok/s per round, their median, and the ratio of medians to chat;
the JSON (benchmarks/results/agent-apis-<device>-<date>.json, a PNG beside it if matplotlib is
installed) also keeps every run's `ember bench serve` summary and the per-round ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from typing import Any

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, ember_server, machine_info, reset_prefix_cache, today, write_json
from benchmarks.server_vs_library import server_flags
from benchmarks.throughput import model_short_name
from ember.bench import serve as bench_serve
from ember.bench.flags import add_serve_bench_args
from ember.bench.machine import load_average
from ember.http_client import CHAT, MESSAGES, RESPONSES

ENDPOINTS = (CHAT, RESPONSES, MESSAGES)  # chat first: the baseline
TARGET_RATIO = 0.95
WARMUP_TOKENS = 8
# `ember bench serve`'s summary keys kept per run
KEPT = (
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "output_throughput",
    "max_concurrency_observed",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "median_e2el_ms",
    "errors",
)
COLORS = {CHAT: "#4a7ab5", RESPONSES: "#d9541e", MESSAGES: "#6a9a3a"}


def bench_args(
    args: argparse.Namespace, base_url: str, endpoint: str, requests: int, max_tokens: int, seed: int
) -> argparse.Namespace:
    """`ember bench serve`'s flags for one run, parsed by its own parser so that its defaults (ignore_eos) apply."""
    parser = argparse.ArgumentParser()
    add_serve_bench_args(parser)
    return parser.parse_args(
        [
            "--base-url",
            base_url,
            "--endpoint",
            endpoint,
            "--dataset",
            "fixed",
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(max_tokens),
            "--num-prompts",
            str(requests),
            "--max-concurrency",
            str(args.max_concurrency),
            "--seed",
            str(seed),
            "--temperature",
            "0",
            "--request-timeout",
            str(args.request_timeout),
            "--disable-tqdm",
        ]
    )


def run_once(
    args: argparse.Namespace, base_url: str, endpoint: str, requests: int, max_tokens: int, seed: int
) -> dict[str, Any]:
    """One `ember bench serve` run on an empty prefix cache; failed requests end the benchmark (nothing to
    compare), a token count other than requested is kept as a warning."""
    asyncio.run(reset_prefix_cache(base_url))
    doc = asyncio.run(bench_serve.benchmark(bench_args(args, base_url, endpoint, requests, max_tokens, seed)))
    summary = {k: doc["results"][k] for k in KEPT}
    if summary["failed"]:
        raise RuntimeError(f"{endpoint}: {summary['failed']} of {requests} requests failed: {summary['errors']}")
    expected = requests * max_tokens
    summary["warning"] = (
        None
        if summary["total_output_tokens"] == expected
        else f"{summary['total_output_tokens']} output tokens, {expected} requested"
    )
    summary["model"] = doc["server"]["model"]
    return summary


def run_rounds(args: argparse.Namespace, base_url: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The warm-up runs, then the rounds, each API's turn rotating; returns (warm-up runs, rounds)."""
    warmup = {}
    for endpoint in ENDPOINTS:
        print(f"warm-up: {endpoint}", flush=True)
        warmup[endpoint] = run_once(args, base_url, endpoint, args.max_concurrency, WARMUP_TOKENS, args.seed)
    rounds = []
    for r in range(args.rounds):
        order = [ENDPOINTS[(r + i) % len(ENDPOINTS)] for i in range(len(ENDPOINTS))]
        seed = args.seed + 1 + r
        record: dict[str, Any] = {"round": r, "loadavg_before": load_average(), "seed": seed, "order": order}
        runs = {}
        for endpoint in order:
            runs[endpoint] = run_once(args, base_url, endpoint, args.num_prompts, args.output_len, seed)
            print(
                f"round {r + 1}/{args.rounds} {endpoint}: {runs[endpoint]['output_throughput']:.2f} output tok/s",
                flush=True,
            )
        record["runs"] = {e: runs[e] for e in ENDPOINTS}
        rounds.append(record)
    return warmup, rounds


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per API: output tok/s per round, their median and its ratio to chat's; the per-round ratios (each API
    against chat in the same round) show how much of a difference is drift."""
    endpoints: dict[str, Any] = {}
    for endpoint in ENDPOINTS:
        per_round = [r["runs"][endpoint]["output_throughput"] for r in rounds]
        endpoints[endpoint] = {"tok_s_per_round": per_round, "median_tok_s": round(statistics.median(per_round), 2)}
    chat = endpoints[CHAT]["median_tok_s"]
    for e in endpoints.values():
        e["ratio_to_chat"] = round(e["median_tok_s"] / chat, 4) if chat else None
        e["ratio_to_chat_per_round"] = [
            round(x / y, 4) if y else None for x, y in zip(e["tok_s_per_round"], endpoints[CHAT]["tok_s_per_round"])
        ]
    met = all(e["ratio_to_chat"] is not None and e["ratio_to_chat"] >= TARGET_RATIO for e in endpoints.values())
    return {"endpoints": endpoints, "target_ratio": TARGET_RATIO, "target_met": met}


def print_table(summary: dict[str, Any], rounds: int) -> None:
    width = max(len(e) for e in ENDPOINTS) + 2
    header = "".join(f"{f'round {r + 1}':>10}" for r in range(rounds))
    print(f"{'endpoint':<{width}}{header}{'median':>10}{'vs chat':>9}   (output tok/s)")
    for endpoint, e in summary["endpoints"].items():
        cells = "".join(f"{v:>10.2f}" for v in e["tok_s_per_round"])
        ratio = "n/a" if e["ratio_to_chat"] is None else f"{e['ratio_to_chat']:.3f}"
        print(f"{endpoint:<{width}}{cells}{e['median_tok_s']:>10.2f}{ratio:>9}")
    print(f"target: /v1/responses and /v1/messages >= {TARGET_RATIO}x chat; met: {summary['target_met']}")


def write_chart(path: str, summary: dict[str, Any], title: str) -> None:
    """Median output tok/s per API (bars, the ratio to chat above), each round's value as a dot, and the
    target line. Optional: without matplotlib there is no chart."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    endpoints = summary["endpoints"]
    names = list(endpoints)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    bars = ax.bar(names, [endpoints[n]["median_tok_s"] for n in names], color=[COLORS[n] for n in names])
    ax.bar_label(bars, labels=[f"{endpoints[n]['ratio_to_chat']:.3f}x" for n in names], fontsize=8, padding=5)
    for i, n in enumerate(names):
        per_round = endpoints[n]["tok_s_per_round"]
        ax.plot([i] * len(per_round), per_round, "o", color="black", markersize=3)
    target = TARGET_RATIO * endpoints[CHAT]["median_tok_s"]
    ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"{TARGET_RATIO}x chat")
    ax.set_ylabel("output tok/s (median; dots: rounds)", fontsize=8)
    ax.margins(y=0.15)
    ax.legend(fontsize=7, loc="lower right")
    ax.tick_params(labelsize=8)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="what `ember serve` loads (default: the default model)")
    p.add_argument("--device", default="cpu", help="`ember serve --device` (default: %(default)s)")
    p.add_argument("--kv-cache-memory", type=float, default=None, help="`ember serve --kv-cache-memory` GiB")
    p.add_argument("--server-args", default="", help="more `ember serve` flags, one string: --server-args='...'")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per API and round (default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=16, help="requests in flight (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=128, help="words of each user message (default: %(default)s)")
    p.add_argument(
        "--output-len", type=int, default=128, help="greedy tokens per request, ignore_eos (default: %(default)s)"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds, every API once in each (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the server may take to become ready")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/agent-apis-<device>-<date>.json); "
        "a PNG chart goes next to it if matplotlib is installed",
    )
    args = p.parse_args(argv)
    if min(args.num_prompts, args.max_concurrency, args.input_len, args.output_len, args.rounds) < 1:
        p.error("--num-prompts, --max-concurrency, lengths and --rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()  # before the server starts: loadavg shows what else was running
    print(
        f"{args.num_prompts} requests per API and round, {args.max_concurrency} in flight, {args.input_len} words "
        f"in, {args.output_len} tokens out, {args.rounds} rounds",
        flush=True,
    )
    with ember_server(args.model, server_flags(args), args.timeout) as server:
        warmup, rounds = run_rounds(args, server.url)
    summary = summarize(rounds)
    print_table(summary, args.rounds)
    warnings = [
        f"round {r['round'] + 1} {e}: {run['warning']}"
        for r in rounds
        for e, run in r["runs"].items()
        if run["warning"]
    ]
    for warning in warnings:
        print(f"WARNING: {warning}")
    model = rounds[0]["runs"][CHAT]["model"]
    out = args.out or os.path.join(RESULTS_DIR, f"agent-apis-{args.device}-{today()}.json")
    write_json(
        out,
        {
            "benchmark": "agent-apis",
            "date": today(),
            "machine": machine,
            "command": sys.argv,
            "config": {**vars(args), "endpoints": list(ENDPOINTS), "model_served": model},
            "results": {**summary, "warnings": warnings, "warmup": warmup, "rounds": rounds},
        },
    )
    write_chart(
        os.path.splitext(out)[0] + ".png",
        summary,
        f"{model_short_name(args.model)} on {args.device}, {args.max_concurrency} in flight, {args.num_prompts} "
        f"requests, {args.input_len} words in, {args.output_len} tokens out, median of {args.rounds}\n"
        f"{machine['cpu']} ({machine['cores']} cores)",
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
