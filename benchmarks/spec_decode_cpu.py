"""Speculative decoding on CPU: output tok/s with and without n-gram speculation on the input-grounded workload.

The workload (DESIGN.md's "input-grounded workload") is benchmarks/data/input_grounded.jsonl: 32 fixed
chat prompts whose answers mostly copy from the prompt (kinds `rewrite`, `edit`, `extract`,
`summarize-quote`, `code-edit`; 150-350 prompt tokens, `max_tokens` 160-256 each), the case where
prompt-lookup (n-gram) drafts should be accepted most often.

One run starts `ember serve` (the default model, `--device cpu`, `--max-model-len 2048`) twice: plain
("off"), then with `--speculative-config '{"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_min": 2, "prompt_lookup_max": 5}'` ("on"). Each server gets one short warm-up
request, then runs the set single stream: one streaming chat completion at a time, temperature 0,
each prompt's `max_tokens`, stopping at EOS as usual (`ignore_eos` false); per request it keeps the
output tokens (the stream's usage), the time from sending to the last event, TTFT and the text. With
`--concurrency N ...` the set then runs again with N requests in flight (repeated to at least N
requests, so that N are in flight at all). The prefix cache is reset before each phase.

Around each phase of the "on" server, /metrics's `ember:spec_decode_*` counters are read; their
differences give the acceptance rate (accepted / draft tokens), the mean accepted length (1 +
accepted / drafts: tokens per forward pass of the model) and each draft position's acceptance rate
(accepted at position i / drafts). Greedy speculation must be exact: every prompt's answer text must
equal the plain server's, and the table counts the prompts where it does not (the exit status is 1
when there are any, as when a server or request fails).

    python benchmarks/spec_decode_cpu.py                        # off and on, single stream
    python benchmarks/spec_decode_cpu.py --k 4 --concurrency 16
    python benchmarks/spec_decode_cpu.py --only off --limit 2   # a quick check of the plain path

The table shows off and on tok/s, the speed-up, acceptance rate, mean accepted length and mismatches
per phase; the JSON (benchmarks/results/spec-decode-cpu-<date>.json, a PNG beside it: tok/s off
against on, and the per-position acceptance) keeps every request, texts included.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from benchmarks.common import (
    RESULTS_DIR,
    ServerError,
    ember_server,
    machine_info,
    reset_prefix_cache,
    today,
    write_json,
)
from benchmarks.throughput import model_short_name
from ember.bench import spec_metrics
from ember.bench.machine import load_average
from ember.http_client import APIS, CHAT, StreamTiming, get_json, stream_completion

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "input_grounded.jsonl")
MODES = ("off", "on")
COLORS = {"off": "#4a7ab5", "on": "#d9541e"}
WARMUP_TOKENS = 8
DRY_RUN_PROMPTS = 2


# ---- one streamed chat completion, its text kept ------------------------------------------------------


@dataclass(kw_only=True)
class Answer(StreamTiming):
    """What `ember.http_client.stream_completion` times, plus the answer's text and finish reason."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None


def _read_chat_text(chunk: dict[str, Any], timing: StreamTiming, now: float, start: float) -> bool:
    """Chat's event reader, keeping each chunk's content on the way."""
    if isinstance(timing, Answer):
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                timing.text.append(content)
            timing.finish_reason = choice.get("finish_reason") or timing.finish_reason
    return APIS[CHAT].read(chunk, timing, now, start)


CHAT_WITH_TEXT = dataclasses.replace(APIS[CHAT], read=_read_chat_text)


async def one_request(base_url: str, model: str, prompt: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One greedy streaming chat completion; a failure is recorded, not raised."""
    max_tokens = prompt["max_tokens"]
    body = {
        "model": model,
        "messages": prompt["messages"],
        "max_tokens": max_tokens,
        "max_completion_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": False,
        **CHAT_WITH_TEXT.stream,
    }
    answer = Answer()
    start = time.perf_counter()
    error = None
    try:
        await asyncio.wait_for(stream_completion(base_url + CHAT, body, {}, CHAT_WITH_TEXT, answer, start), timeout)
    except asyncio.TimeoutError:  # before OSError: it is one since Python 3.11
        error = f"timed out after {timeout:g} s"
    except Exception as e:  # noqa: BLE001 - HTTP, stream or connection errors: one failed request each
        error = f"{type(e).__name__}: {e}"
    return {
        "id": prompt["id"],
        "kind": prompt["kind"],
        "max_tokens": max_tokens,
        "prompt_tokens": answer.prompt_tokens,
        "output_tokens": answer.output_tokens,
        "e2e_s": None if answer.e2e is None else round(answer.e2e, 4),
        "ttft_s": None if answer.ttft is None else round(answer.ttft, 4),
        "finish_reason": answer.finish_reason,
        "text": "".join(answer.text),
        "error": error,
    }


async def run_phase(
    base_url: str, model: str, prompts: list[dict[str, Any]], in_flight: int, timeout: float
) -> tuple[list[dict[str, Any]], float]:
    """All `prompts`, at most `in_flight` at a time; returns the records in prompt order and the wall seconds
    from the first request sent to the last finished."""
    limit = asyncio.Semaphore(in_flight)

    async def one(prompt: dict[str, Any]) -> dict[str, Any]:
        async with limit:
            return await one_request(base_url, model, prompt, timeout)

    start = time.perf_counter()
    records = await asyncio.gather(*(one(p) for p in prompts))
    return list(records), time.perf_counter() - start


# ---- one server, every phase -----------------------------------------------------------------------------


def phases(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(name, requests in flight) of each phase, single stream first."""
    return [("single", 1), *((f"c{c}", c) for c in args.concurrency)]


def phase_prompts(prompts: list[dict[str, Any]], in_flight: int) -> list[dict[str, Any]]:
    """The set, repeated (whole) until it has at least `in_flight` requests."""
    return prompts * max(1, -(-in_flight // len(prompts)))


def summarize_phase(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r["error"] is None]
    tokens = sum(r["output_tokens"] or 0 for r in ok)

    def median(key: str) -> float | None:
        values = [r[key] for r in ok if r[key] is not None]
        return round(statistics.median(values), 4) if values else None

    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "tok_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
        "median_ttft_s": median("ttft_s"),
        "median_e2e_s": median("e2e_s"),
        "errors": sorted({r["error"] for r in records if r["error"] is not None}),
    }


async def run_server_phases(args: argparse.Namespace, base_url: str, prompts: list[dict[str, Any]]) -> dict[str, Any]:
    models = await get_json(base_url + "/v1/models", {})
    model = models["data"][0]["id"]
    warm = await one_request(base_url, model, {**prompts[0], "max_tokens": WARMUP_TOKENS}, args.request_timeout)
    if warm["error"] is not None:
        raise RuntimeError(f"the warm-up request failed: {warm['error']}")
    run: dict[str, Any] = {"model": model, "phases": {}}
    for name, in_flight in phases(args):
        await reset_prefix_cache(base_url)
        loadavg = load_average()
        before = await spec_metrics.read_counters(base_url, {})
        records, wall_s = await run_phase(
            base_url, model, phase_prompts(prompts, in_flight), in_flight, args.request_timeout
        )
        spec = spec_metrics.summarize(before, await spec_metrics.read_counters(base_url, {}))
        summary = summarize_phase(records, wall_s)
        run["phases"][name] = {
            "in_flight": in_flight,
            "loadavg_before": loadavg,
            **summary,
            "spec_decode": spec,
            "records": records,
        }
        accepted = "" if spec is None else f", acceptance {spec['acceptance_rate']}"
        print(f"  {name}: {summary['output_tokens']} tokens in {wall_s:.1f} s, {summary['tok_s']} tok/s{accepted}")
        for error in summary["errors"]:
            print(f"  WARNING: {name}: {summary['failed']} failed: {error}")
    return run


def speculative_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
    }


def server_flags(args: argparse.Namespace, mode: str) -> list[str]:
    flags = [f"--device={args.device}", f"--max-model-len={args.max_model_len}", *shlex.split(args.server_args)]
    if mode == "on":
        flags += ["--speculative-config", json.dumps(speculative_config(args))]
    return flags


def run_mode(args: argparse.Namespace, mode: str, prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """Start the server of `mode`, run every phase on it; a server that fails is recorded, not fatal."""
    flags = server_flags(args, mode)
    print(f"{mode}: ember serve {shlex.join(flags)}", flush=True)
    try:
        with ember_server(args.model, flags, args.timeout) as server:
            run = asyncio.run(run_server_phases(args, server.url, prompts))
    except ServerError as e:
        sys.stdout.flush()  # before stderr's lines, where both go to one terminal or file
        hint = (
            " (does this `ember serve` take --speculative-config yet? see `ember serve --help`; "
            "`--only off` runs the plain server alone)"
            if mode == "on"
            else ""
        )
        print(f"ERROR: the {mode!r} server failed: {e}{hint}", file=sys.stderr)
        return {"server_flags": flags, "error": f"{e}{hint}", "log_tail": e.log_tail}
    return {"server_flags": flags, **run}


# ---- comparing and reporting -----------------------------------------------------------------------------


def mismatches(off: dict[str, Any], on: dict[str, Any]) -> list[str]:
    """The requests (by position in the phase, as 'index:id') whose answer text differs between off and on."""
    return [
        f"{i}:{a['id']}"
        for i, (a, b) in enumerate(zip(off["records"], on["records"]))
        if a["error"] is None and b["error"] is None and a["text"] != b["text"]
    ]


def compare(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One row per phase: off and on tok/s, the speed-up, on's acceptance and the answers that differ."""
    rows = {}
    for name, _ in phases(args):
        got = {m: runs[m]["phases"][name] for m in runs if "error" not in runs[m]}
        off, on = got.get("off"), got.get("on")
        spec = (on or {}).get("spec_decode") or {}
        both = off is not None and on is not None
        diff = mismatches(off, on) if both else None
        rows[name] = {
            "off_tok_s": off and off["tok_s"],
            "on_tok_s": on and on["tok_s"],
            "speedup": round(on["tok_s"] / off["tok_s"], 4) if both and off["tok_s"] and on["tok_s"] else None,
            "acceptance_rate": spec.get("acceptance_rate"),
            "mean_accepted_length": spec.get("mean_accepted_length"),
            "acceptance_per_pos": spec.get("acceptance_per_position"),
            "mismatches": None if diff is None else len(diff),
            "mismatched": diff,
        }
    return rows


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    def cell(v: Any, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    print(
        f"{'phase':<8}{'off tok/s':>11}{'on tok/s':>11}{'speed-up':>10}{'acceptance':>12}{'mean acc len':>14}"
        f"{'mismatches':>12}"
    )
    for name, r in rows.items():
        print(
            f"{name:<8}{cell(r['off_tok_s'], '.2f'):>11}{cell(r['on_tok_s'], '.2f'):>11}"
            f"{cell(r['speedup'], '.3f'):>10}{cell(r['acceptance_rate'], '.3f'):>12}"
            f"{cell(r['mean_accepted_length'], '.3f'):>14}{cell(r['mismatches'], 'd'):>12}"
        )


def write_chart(path: str, rows: dict[str, dict[str, Any]], title: str) -> None:
    """Left: output tok/s off and on per phase (the speed-up above on's bar); right: each draft position's
    acceptance rate per phase. Optional: without matplotlib there is no chart."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    width = 0.38
    for j, mode in enumerate(MODES):
        if all(rows[n][f"{mode}_tok_s"] is None for n in names):  # a mode not run (`--only`) or failed
            continue
        xs = [i + (j - 0.5) * width for i in range(len(names))]
        values = [rows[n][f"{mode}_tok_s"] or 0.0 for n in names]
        bars = left.bar(xs, values, width, label=f"spec decode {mode}", color=COLORS[mode])
        if mode == "on":
            labels = ["" if rows[n]["speedup"] is None else f"{rows[n]['speedup']:.2f}x" for n in names]
            left.bar_label(bars, labels=labels, fontsize=8, padding=3)
    left.set_xticks(range(len(names)), names)
    left.set_ylabel("output tok/s", fontsize=8)
    left.margins(y=0.15)
    if left.get_legend_handles_labels()[0]:  # neither mode ran: no bars
        left.legend(fontsize=7, loc="lower right")
    left.tick_params(labelsize=8)
    positions = 0
    for n in names:
        per_pos = rows[n]["acceptance_per_pos"] or []
        if per_pos:
            right.plot(range(len(per_pos)), per_pos, "o-", label=n)
            positions = max(positions, len(per_pos))
    if positions:
        right.set_xticks(range(positions))
        right.set_ylim(0, 1)
        right.set_xlabel("draft position", fontsize=8)
        right.set_ylabel("accepted / drafts", fontsize=8)
        right.legend(fontsize=7)
    else:
        right.text(0.5, 0.5, "no spec-decode metrics", ha="center", va="center", fontsize=9)
        right.set_xticks([])
        right.set_yticks([])
    right.tick_params(labelsize=8)
    right.set_title("per-position acceptance", fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- command line -------------------------------------------------------------------------------------


def load_prompts(path: str, limit: int | None) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        prompts = [json.loads(line) for line in f if line.strip()]
    return prompts[:limit] if limit else prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="what `ember serve` loads (default: the default model)")
    p.add_argument("--device", default="cpu", help="`ember serve --device` (default: %(default)s)")
    p.add_argument(
        "--max-model-len", type=int, default=2048, help="`ember serve --max-model-len` (default: %(default)s)"
    )
    p.add_argument("--server-args", default="", help="more `ember serve` flags for both servers: --server-args='...'")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the on server (default: %(default)s)")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--prompt-lookup-max", type=int, default=5, help="(default: %(default)s)")
    p.add_argument("--data", default=DATA, help="the prompts, JSON lines (default: the input-grounded set)")
    p.add_argument("--limit", type=int, default=None, help="run only the first N prompts")
    p.add_argument("--dry-run", action="store_true", help=f"a quick check: --limit {DRY_RUN_PROMPTS}")
    p.add_argument(
        "--concurrency", type=int, nargs="*", default=[], help="also run the set with N in flight, per N (e.g. 16)"
    )
    p.add_argument("--only", choices=MODES, default=None, help="run one server: off (plain) or on (speculative)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a server may take to become ready")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/spec-decode-cpu-<date>.json); the PNG chart goes next to it",
    )
    args = p.parse_args(argv)
    if args.dry_run and args.limit is None:
        args.limit = DRY_RUN_PROMPTS
    if min(args.k, args.prompt_lookup_min, args.max_model_len, *args.concurrency, args.limit or 1) < 1:
        p.error("--k, --prompt-lookup-min, --max-model-len, --concurrency and --limit must be >= 1")
    if args.prompt_lookup_max < args.prompt_lookup_min:
        p.error("--prompt-lookup-max must be >= --prompt-lookup-min")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()  # before the servers start: loadavg shows what else was running
    prompts = load_prompts(args.data, args.limit)
    modes = [args.only] if args.only else list(MODES)
    print(f"{len(prompts)} prompts from {args.data}; phases: {', '.join(n for n, _ in phases(args))}", flush=True)
    runs = {mode: run_mode(args, mode, prompts) for mode in modes}
    rows = compare(args, runs)
    print_table(rows)
    failed = [f"the {m!r} server failed (see above)" for m, r in runs.items() if "error" in r] + [
        f"{m} {name}: {ph['failed']} of {ph['requests']} requests failed"
        for m, r in runs.items()
        if "error" not in r
        for name, ph in r["phases"].items()
        if ph["failed"]
    ]
    mismatched = {name: r["mismatched"] for name, r in rows.items() if r["mismatches"]}
    for name, which in mismatched.items():
        print(f"WARNING: {name}: greedy answers differ between off and on for {', '.join(which)}")
    for what in failed:
        print(f"ERROR: {what}")

    out = args.out or os.path.join(RESULTS_DIR, f"spec-decode-cpu-{today()}.json")
    write_json(
        out,
        {
            "benchmark": "spec-decode-cpu",
            "date": today(),
            "machine": machine,
            "command": sys.argv,
            "config": {
                **vars(args),
                "modes": modes,
                "prompt_ids": [p["id"] for p in prompts],
                "speculative_config": speculative_config(args),
            },
            "results": {"summary": rows, "runs": runs},
        },
    )
    requests = sum(len(phase_prompts(prompts, c)) for _, c in phases(args))
    write_chart(
        os.path.splitext(out)[0] + ".png",
        rows,
        f"{model_short_name(args.model)} on {args.device}, input-grounded set ({len(prompts)} prompts, "
        f"{requests} requests per server), ngram k={args.k}, lookup {args.prompt_lookup_min}-{args.prompt_lookup_max}, "
        f"greedy\n{machine['cpu']} ({machine['cores']} cores)",
    )
    print(f"wrote {out}")
    return 1 if failed or mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
