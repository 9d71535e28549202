"""The README's performance tables, rebuilt from the result files: one row per target, the measured
value next to it, and a PNG chart of measured / target for every row.

    python benchmarks/summary.py --date 2026-12-02

Rows whose result file is missing are listed as not measured rather than dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

if not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, today, write_json


@dataclass
class Row:
    what: str
    files: tuple[str, ...]  # result files (without the directory), {date} filled in
    value: Callable[[list[dict[str, Any]]], float]
    target: float
    unit: str
    higher_is_better: bool = True


def _tput(r: list[dict[str, Any]]) -> float:
    return r[0]["results"]["ember"]["output_tok_per_s"]


ROWS = [
    Row(
        "offline throughput, Qwen3-0.6B shape (H200)",
        ("throughput-qwen3-0.6b-cuda-{date}-with-serve.json",),
        _tput,
        25000,
        "out tok/s",
    ),
    Row(
        "offline throughput, Llama-3.1-8B shape (H200)",
        ("throughput-llama-3.1-8b-cuda-{date}.json",),
        _tput,
        9000,
        "out tok/s",
    ),
    Row(
        "batch-1 TPOT, Llama-3.1-8B shape (H200)",
        ("latency-llama-3.1-8b-cuda-{date}.json",),
        lambda r: r[0]["results"]["tpot_ms"],
        4.6,
        "ms",
        higher_is_better=False,
    ),
    Row(
        "online / offline throughput, Qwen3-0.6B shape (H200)",
        ("serve-qwen3-0.6b-cuda-{date}.json", "throughput-qwen3-0.6b-cuda-{date}-with-serve.json"),
        lambda r: r[0]["results"]["output_throughput"] / _tput(r[1:]),
        0.85,
        "x",
    ),
    Row(
        "start-up to /health 200, Qwen3-0.6B shape, CUDA graphs (H200)",
        ("startup-qwen3-0.6b-cuda-{date}.json",),
        lambda r: r[0]["results"]["median"]["ready_s"],
        15,
        "s",
        higher_is_better=False,
    ),
    Row(
        "start-up to /health 200, Qwen3-0.6B shape, eager (H200)",
        ("startup-qwen3-0.6b-cuda-eager-{date}.json",),
        lambda r: r[0]["results"]["median"]["ready_s"],
        5,
        "s",
        higher_is_better=False,
    ),
    Row(
        "Ember / HF continuous batching, same 64 requests (H200)",
        ("throughput-qwen3-0.6b-cuda-{date}.json",),
        lambda r: r[0]["results"]["ratio"],
        1.0,
        "x",
    ),
    Row(
        "int4 batch-1 TPOT, 8B shape (H200)",
        ("latency-llama-3.1-8b-int4-cuda-{date}.json",),
        lambda r: r[0]["results"]["tpot_ms"],
        1.6,
        "ms",
        higher_is_better=False,
    ),
    Row(
        "int8 batch-1 TPOT, 8B shape (H200)",
        ("latency-llama-3.1-8b-int8-cuda-{date}.json",),
        lambda r: r[0]["results"]["tpot_ms"],
        2.6,
        "ms",
        higher_is_better=False,
    ),
    Row(
        "int4 weight memory / bf16, 8B shape",
        ("latency-llama-3.1-8b-int4-cuda-{date}.json", "latency-llama-3.1-8b-cuda-{date}.json"),
        lambda r: r[0]["results"]["weights_gib"] / r[1]["results"]["weights_gib"],
        0.30,
        "ratio",
        higher_is_better=False,
    ),
    Row(
        "int8 weight memory / bf16, 8B shape",
        ("latency-llama-3.1-8b-int8-cuda-{date}.json", "latency-llama-3.1-8b-cuda-{date}.json"),
        lambda r: r[0]["results"]["weights_gib"] / r[1]["results"]["weights_gib"],
        0.52,
        "ratio",
        higher_is_better=False,
    ),
    *(
        Row(
            f"perplexity increase, {mode}, default model (H200)",
            ("quality-smollm2-135m-instruct-cuda-{date}.json",),
            lambda r, mode=mode: r[0]["results"][mode]["ppl_delta_pct"],
            bound,
            "%",
            higher_is_better=False,
        )
        for mode, bound in (("int8", 1.0), ("fp8", 2.0), ("int4", 10.0))
    ),
    Row(
        "fp8 weights / bf16 offline throughput, 8B shape (H200)",
        ("throughput-llama-3.1-8b-fp8-cuda-{date}.json", "throughput-llama-3.1-8b-cuda-{date}.json"),
        lambda r: _tput(r[:1]) / _tput(r[1:]),
        1.3,
        "x",
    ),
    Row(
        "fp8 KV / bf16 KV offline throughput, Qwen3-0.6B shape (H200)",
        ("throughput-qwen3-0.6b-fp8kv-cuda-{date}.json", "throughput-qwen3-0.6b-cuda-{date}.json"),
        lambda r: _tput(r[:1]) / _tput(r[1:]),
        1.3,
        "x",
    ),
]


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def load(row: Row, date: str) -> list[dict[str, Any]] | None:
    paths = [os.path.join(RESULTS_DIR, f.format(date=date)) for f in row.files]
    if not all(os.path.isfile(p) for p in paths):
        return None
    results = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            results.append(json.load(f))
    return results


def write_chart(path: str, rows: list[dict[str, Any]], title: str) -> None:
    """Measured / target per row (1.0 = on target, above is better); matplotlib is optional."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r["value"] is not None]
    # clipped at 2 so one large ratio does not flatten the rest; the label keeps the real value
    scores = [
        min(2.0, r["value"] / r["target"] if r["higher_is_better"] else r["target"] / r["value"]) for r in measured
    ]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(measured) + 1.2))
    bars = ax.barh([r["what"] for r in measured], scores, color=["#3a8a4a" if s >= 1 else "#d9541e" for s in scores])
    ax.bar_label(
        bars,
        labels=[f"{_fmt(r['value'])} {r['unit']} (target {_fmt(r['target'])})" for r in measured],
        fontsize=7,
        padding=3,
    )
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("measured / target (>= 1 meets it; clipped at 2)")
    ax.set_xlim(0, 3.4)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--date", default=today(), help="the date in the result file names")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/summary-<date>.json)")
    args = ap.parse_args()
    rows = []
    for row in ROWS:
        results = load(row, args.date)
        value = None if results is None else row.value(results)
        rows.append(
            {
                "what": row.what,
                "value": value,
                "target": row.target,
                "unit": row.unit,
                "higher_is_better": row.higher_is_better,
                "files": [f.format(date=args.date) for f in row.files],
            }
        )
        shown = "not measured" if value is None else f"{_fmt(value)} {row.unit}"
        met = (
            ""
            if value is None
            else (" (met)" if (value >= row.target) == row.higher_is_better or value == row.target else " (missed)")
        )
        print(f"| {row.what} | {'>=' if row.higher_is_better else '<='} {_fmt(row.target)} {row.unit} | {shown}{met} |")
    out = args.out or os.path.join(RESULTS_DIR, f"summary-{args.date}.json")
    write_json(
        out, {"benchmark": "summary", "date": args.date, "command": sys.argv, "config": vars(args), "results": rows}
    )
    write_chart(os.path.splitext(out)[0] + ".png", rows, f"Ember against its targets, results of {args.date}")
    print("wrote", out)


if __name__ == "__main__":
    main()
