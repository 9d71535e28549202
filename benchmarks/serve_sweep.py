"""Serving latency against load: a saturation run, then Poisson arrivals at fractions of its request rate.

A server's throughput with every request sent at once says how much it can do; what users see at a
given load is the TTFT and TPOT under Poisson arrivals below that. So the sweep first sends all
`--num-prompts` requests at once (the nano-vllm workload by default) and takes the saturation request
rate (completed / duration), then runs `--sweep-prompts` requests at each of `--fractions` of that
rate. Each run is `ember bench serve`'s client called in-process (`ember.bench.serve.benchmark`), so
any OpenAI-compatible server works (Ember, vLLM, llama.cpp's server), and the flags are that
command's, less the load flags this script sets.

    ember serve benchmarks/configs/qwen3-0.6b --load-format dummy &
    python benchmarks/serve_sweep.py --base-url http://127.0.0.1:8000
    python benchmarks/serve_sweep.py --base-url http://127.0.0.1:8000 --num-prompts 8 --sweep-prompts 8 \\
        --dataset random --random-input-len 32 --random-output-len 16 --fractions 0.5 1.0   # quick

Run k (the saturation run is 0) sends its prompts with seed `--seed + k`: for the nano-vllm dataset
that shifts every token id (the same lengths), so no run finds its prompts in the server's prefix
cache from an earlier one.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from typing import Any

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, today, write_json
from benchmarks.throughput import model_short_name
from ember.bench import serve as bench_serve
from ember.bench.flags import add_serve_bench_args, check_args
from ember.bench.machine import client_machine_info

TTFT_P99_TARGET_MS = 150.0  # the design target for Poisson load at 50% and 80% of saturation
# `ember bench serve`'s summary keys kept per run
KEPT = (
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "completed",
    "failed",
    "failures_by_kind",
    "duration_s",
    "max_concurrency_observed",
)
# flags of `ember bench serve` this script sets per run (rate, label), or does without (--out replaces
# --result-file; the JSON keeps no per-request records)
SET_HERE = ("--request-rate", "--max-concurrency", "--label", "--result-file", "--save-detailed")


def run_once(args: argparse.Namespace, num_prompts: int, rate: float, seed: int, label: str) -> dict[str, Any]:
    """One `ember bench serve` run with the sweep's flags; returns its result document."""
    bench_args = argparse.Namespace(
        **{**vars(args), "num_prompts": num_prompts, "request_rate": rate, "seed": seed, "label": label}
    )
    return asyncio.run(bench_serve.benchmark(bench_args))


def row(
    label: str, fraction: float | None, offered_rate: float | None, seed: int, summary: dict[str, Any]
) -> dict[str, Any]:
    """What the table, the plot and the JSON keep of a run. `request_throughput` is the rate achieved."""
    p99_ttft = summary["p99_ttft_ms"]
    return {
        "label": label,
        "fraction": fraction,
        "offered_request_rate": offered_rate,
        "seed": seed,
        **{k: summary[k] for k in KEPT},
        "meets_ttft_p99_target": None if p99_ttft is None else p99_ttft <= TTFT_P99_TARGET_MS,
    }


def sweep(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """The saturation run, then one Poisson run per fraction; returns their rows and the model the server named."""
    doc = run_once(args, args.num_prompts, math.inf, args.seed, "saturation")
    saturation = row("saturation", None, None, args.seed, doc["results"])
    rate = saturation["request_throughput"]
    print(f"saturation: {rate:.3f} req/s, {saturation['output_throughput']:.1f} output tok/s", flush=True)
    if not rate:
        raise SystemExit("error: no request of the saturation run succeeded; nothing to sweep")
    runs = []
    for k, fraction in enumerate(args.fractions, start=1):
        label = f"poisson {fraction:g}x"
        print(f"{label}: {fraction * rate:.3f} req/s, {args.sweep_prompts} requests", flush=True)
        summary = run_once(args, args.sweep_prompts, fraction * rate, args.seed + k, label)["results"]
        runs.append(row(label, fraction, round(fraction * rate, 4), args.seed + k, summary))
    return saturation, runs, doc["server"]["model"]


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = (
        ("offered_request_rate", "offered/s"),
        ("request_throughput", "req/s"),
        ("output_throughput", "out tok/s"),
        ("median_ttft_ms", "TTFT med"),
        ("p99_ttft_ms", "TTFT p99"),
        ("median_tpot_ms", "TPOT med"),
        ("p99_tpot_ms", "TPOT p99"),
        ("median_itl_ms", "ITL med"),
        ("p99_itl_ms", "ITL p99"),
        ("median_e2el_ms", "E2E med"),
        ("failed", "failed"),
    )
    print(f"{'run':<16}" + "".join(f"{h:>11}" for _, h in columns) + "   (times in ms)")
    for r in rows:
        cells = ("-" if r[k] is None else f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k, _ in columns)
        print(f"{r['label']:<16}" + "".join(f"{c:>11}" for c in cells))
    print(f"p99 TTFT target: <= {TTFT_P99_TARGET_MS:g} ms at 0.5x and 0.8x of saturation")


def write_chart(path: str, saturation: dict[str, Any], runs: list[dict[str, Any]], title: str) -> None:
    """TTFT and TPOT (median, p99) against the offered request rate. Optional: without matplotlib, no chart."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["offered_request_rate"] for r in runs]
    fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in ((ttft, "ttft"), (tpot, "tpot")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(rates, [r[f"{stat}_{metric}_ms"] for r in runs], style, label=f"{stat} {metric.upper()}")
        for r in runs:
            ax.annotate(
                f"{r['fraction']:g}x",
                (r["offered_request_rate"], r[f"p99_{metric}_ms"] or 0),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=7,
            )
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.grid(alpha=0.3)
    ttft.axhline(TTFT_P99_TARGET_MS, color="red", linewidth=1, label=f"p99 TTFT target {TTFT_P99_TARGET_MS:g} ms")
    ttft.set_yscale("log")  # p99 near saturation is seconds, the target a fraction of one
    for ax in (ttft, tpot):
        ax.legend(fontsize=7)
    fig.suptitle(
        f"{title}\nsaturation (all at once): {saturation['request_throughput']:.2f} req/s, "
        f"{saturation['output_throughput']:.0f} output tok/s",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The other flags are `ember bench serve`'s; --num-prompts sizes the saturation run.",
    )
    add_serve_bench_args(p, omit=SET_HERE)
    p.set_defaults(dataset="nano-vllm", num_prompts=256, temperature=0.6, max_concurrency=None, save_detailed=False)
    p.add_argument(
        "--fractions",
        type=_fraction,
        nargs="+",
        default=[0.25, 0.5, 0.8, 1.0],
        help="Poisson request rates as fractions of the saturation rate (default: %(default)s)",
    )
    p.add_argument("--sweep-prompts", type=int, default=256, help="requests per Poisson run (default: %(default)s)")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/serve-sweep-<model>-<date>"
        ".json); a PNG chart goes next to it if matplotlib is installed",
    )
    args = p.parse_args(argv)
    if args.sweep_prompts < 1:
        p.error("--sweep-prompts must be >= 1")
    try:
        check_args(args)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = client_machine_info()  # the client's; the server may run elsewhere
    try:
        saturation, runs, model = sweep(args)
    except ValueError as e:  # `benchmark` found no model to ask for: the server is down, or lists none
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table([saturation, *runs])
    out = args.out or os.path.join(RESULTS_DIR, f"serve-sweep-{model_short_name(model)}-{today()}.json")
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    config.update(model_served=model, api_key_set=bool(args.api_key or os.environ.get("EMBER_API_KEY")))
    write_json(
        out,
        {
            "benchmark": "serve-sweep",
            "date": today(),
            "machine": machine,
            "command": sys.argv,
            "config": config,
            "results": {"saturation": saturation, "runs": runs, "ttft_p99_target_ms": TTFT_P99_TARGET_MS},
        },
    )
    write_chart(
        os.path.splitext(out)[0] + ".png",
        saturation,
        runs,
        f"{model_short_name(model)}, {args.dataset} dataset, {args.sweep_prompts} requests per rate",
    )
    print(f"wrote {out}")
    return 0 if all(r["completed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
