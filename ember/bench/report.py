"""`ember bench serve`'s metrics: each request's result, their distributions, the summary, its table and records.

The definitions follow vLLM's `benchmark_serving` (ember/bench/serve.py lists them); a failed request
counts in `failed` and its error kind, never in a distribution.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ember.http_client import StreamTiming

ERRORS_KEPT = 5  # distinct error messages kept in the result, in order of first sight
STATS = ("mean", "median", "std", "p90", "p99")
METRICS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


@dataclass
class RequestResult(StreamTiming):
    """One request: what the client saw of its stream, and whether it succeeded (else why not)."""

    prompt_len: int
    max_tokens: int
    success: bool = False
    error: str | None = None
    start_s: float = 0.0  # when it was sent, seconds after the benchmark started
    end_s: float = 0.0  # when it ended, failed or not, on the same clock

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens is None or self.output_tokens < 2:
            return None
        assert self.e2e is not None and self.ttft is not None  # stream_completion sets both on success
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks, as numpy.percentile does by default."""
    k = (len(sorted_values) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std, p90, p99 in milliseconds; None for each when there are no values."""
    if not values_s:
        return dict.fromkeys(STATS)
    ms = sorted(v * 1e3 for v in values_s)
    mean = sum(ms) / len(ms)
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))
    return {
        "mean": round(mean, 3),
        "median": round(percentile(ms, 50), 3),
        "std": round(std, 3),
        "p90": round(percentile(ms, 90), 3),
        "p99": round(percentile(ms, 99), 3),
    }


def most_in_flight(results: Sequence[RequestResult]) -> int:
    """The most requests in flight at once, from each one's [start_s, end_s]: exact whichever client process sent
    it (one that ends as another starts is not counted twice)."""
    events = sorted([(r.start_s, 1) for r in results] + [(r.end_s, -1) for r in results])
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]  # stream_completion set each one's ttft, e2e and output_tokens
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok if r.output_tokens is not None)
    seconds = max(duration, 1e-9)
    errors = Counter(r.error for r in results if not r.success)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": round(duration, 6),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": round(len(ok) / seconds, 4),
        "input_throughput": round(input_tokens / seconds, 3),
        "output_throughput": round(output_tokens / seconds, 3),
        "total_token_throughput": round((input_tokens + output_tokens) / seconds, 3),
        "max_concurrency_observed": most_in_flight(results),
    }
    per_metric: dict[str, list[float]] = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2e for r in ok if r.e2e is not None],
    }
    for name, values in per_metric.items():
        for stat, value in distribution(values).items():
            summary[f"{stat}_{name}_ms"] = value
    summary["failures_by_kind"] = dict(Counter(error_kind(r.error) for r in results if not r.success))
    summary["errors"] = [{"message": msg, "count": n} for msg, n in list(errors.items())[:ERRORS_KEPT]]
    return summary


def error_kind(error: str | None) -> str:
    """'HTTP 400', 'timeout', or the exception's name: failures grouped whatever their message's details."""
    if error is None:
        return "unknown"
    if error.startswith("timed out"):
        return "timeout"
    return error.split(":", 1)[0]


def request_records(results: Sequence[RequestResult], detailed: bool) -> list[dict[str, Any]]:
    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 3)

    records = []
    for r in results:
        rec: dict[str, Any] = {
            "success": r.success,
            "error": r.error,
            "start_s": round(r.start_s, 4),
            "prompt_tokens": r.input_tokens,
            "max_tokens": r.max_tokens,
            "output_tokens": r.output_tokens,
            "ttft_ms": ms(r.ttft),
            "tpot_ms": ms(r.tpot),
            "e2el_ms": ms(r.e2e),
        }
        if detailed:
            rec["itl_ms"] = [ms(v) for v in r.itl]
        records.append(rec)
    return records


def print_report(summary: dict[str, Any], label: str | None) -> None:
    width = 50

    def row(name: str, value: Any, fmt: str = "") -> None:
        text = "n/a" if value is None else format(value, fmt)
        print(f"{name:<40}{text:>10}")

    print(f" Serving Benchmark Result{f' ({label})' if label else ''} ".center(width, "="))
    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Maximum concurrency observed:", summary["max_concurrency_observed"])
    if "client_processes" in summary:
        row("Client processes:", summary["client_processes"])
    row("Benchmark duration (s):", summary["duration_s"], ".2f")
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"], ".2f")
    row("Input token throughput (tok/s):", summary["input_throughput"], ".2f")
    row("Output token throughput (tok/s):", summary["output_throughput"], ".2f")
    row("Total token throughput (tok/s):", summary["total_token_throughput"], ".2f")
    for key, title, short in METRICS:
        print(f" {title} ".center(width, "-"))
        for stat in STATS:
            name = {"mean": "Mean", "median": "Median", "std": "Std", "p90": "P90", "p99": "P99"}[stat]
            row(f"{name} {short} (ms):", summary[f"{stat}_{key}_ms"], ".2f")
    spec = summary.get("spec_decode")
    if spec is not None:
        print(" Speculative Decoding ".center(width, "-"))
        row("Drafts:", spec["num_drafts"])
        row("Draft tokens:", spec["num_draft_tokens"])
        row("Accepted tokens:", spec["num_accepted_tokens"])
        row("Acceptance rate:", spec["acceptance_rate"], ".3f")
        row("Mean accepted length:", spec["mean_accepted_length"], ".3f")
        per_pos = ", ".join("n/a" if a is None else f"{a:.2f}" for a in spec["acceptance_per_position"])
        print(f"Acceptance per position: {per_pos}")
    if summary["errors"]:
        print(" Failures ".center(width, "-"))
        for kind, n in summary["failures_by_kind"].items():
            row(f"{kind}:", n)
        print("first distinct messages:")
        for e in summary["errors"]:
            print(f"{e['count']:>5} x {e['message']}")
    print("=" * width)
