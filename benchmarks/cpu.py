"""CPU speed and footprint: Ember's server against llama.cpp's `llama-server` and HF transformers, side by side.

One run measures, for one GGUF model (default: SmolLM2-135M-Instruct Q4_1), 128-token prompts and 128
new tokens, the median of `--repeats` runs of each column:

- single-stream generation tok/s (one request at a time) and its decode-only rate,
- total generation tok/s with 16 and with 32 requests in flight,
- prompt processing tok/s: one prompt at a time (like llama-bench's pp128) and a batch of prompts at once,
- start-up seconds (spawn to ready) and idle resident memory after one request.

The servers are driven over HTTP with `ember bench serve`'s client (OpenAI completions, token-id
prompts, temperature 0, `ignore_eos`), so both pay the same HTTP and JSON costs. Every repeat starts
each engine fresh, engines taking turns (Ember, llama.cpp, HF, Ember, ...), so that a change in the
machine's load during the run hits all of them alike. All engines get the same prompts: repeat r's
measurement k draws its token ids with seed `--seed + 1000 r + k`, so no prompt repeats (no
prefix-cache hits) and every engine sees the same ones.

    python benchmarks/cpu.py                                                  # Ember alone
    python benchmarks/cpu.py --llama-server /tmp/llamacpp/build/bin/llama-server --hf
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import multiprocessing
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, ServerProcess, free_port, machine_info, server_command, today, write_json
from benchmarks.startup import process_tree, rss_mib
from benchmarks.throughput import load_hf_model, model_short_name
from ember.bench import serve as bench_serve
from ember.bench.cpu_info import cpu_info
from ember.bench.flags import add_serve_bench_args
from ember.bench.gguf_files import SHAPES, cached_model
from ember.bench.machine import load_average
from ember.bench.report import percentile
from ember.bench.workloads import make_requests
from ember.model.files import resolve_model

COLORS = {"ember": "#d9541e", "llama.cpp": "#6a9a3a", "hf": "#4a7ab5"}
SEEDS_PER_REPEAT = 1000
# the summary keys of `ember bench serve` kept per measurement (the HF runs fill the same ones)
KEPT = (
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "input_throughput",
    "output_throughput",
    "median_e2el_ms",
    "p99_e2el_ms",
    "median_ttft_ms",
    "median_tpot_ms",
    "errors",
)


# ---- what the columns are -------------------------------------------------------------------------


def columns(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(result key, table header) of each column, in table order; the keys name what a run reports."""
    return [
        ("single_tok_s", "1-stream tok/s"),
        ("decode_tok_s", "decode tok/s"),
        *((f"c{c}_tok_s", f"c{c} tok/s") for c in args.concurrency),
        ("pp_tok_s", f"pp{args.input_len} tok/s"),
        ("pp_batch_tok_s", f"pp x{args.pp_requests} tok/s"),
        ("startup_s", "start-up s"),
        ("idle_rss_mib", "idle RSS MiB"),
    ]


def derive(args: argparse.Namespace, run: dict[str, Any]) -> dict[str, float | None]:
    """The columns from one run's measurements; the same arithmetic for every engine.

    Only whole-request times are used (E2E: sent to last byte), never the time of a request's first
    text chunk: a server may send its first token late (an incomplete UTF-8 character, a skipped
    special token), and then TTFT would not be the prefill's time.

    single: output tokens / wall time, requests one after another (each request's prefill included);
    decode: (output_len - 1) / (median E2E of those - median E2E of a max_tokens=1 request), the
        token rate after the prefill, like llama-bench's tg;
    cN: output tokens / wall time for N requests sent at once (first sent to last finished);
    pp: input_len / median E2E of max_tokens=1 requests sent one after another, like llama-bench's pp;
    pp batch: prompt tokens / wall time for `--pp-requests` max_tokens=1 requests sent at once.
    """

    def rate(tokens: float, ms: float) -> float | None:
        return tokens * 1e3 / ms if ms > 0 else None

    m = run["measurements"]
    prefill_ms = m["pp_single"]["median_e2el_ms"]
    out = {
        "single_tok_s": m["single"]["output_throughput"],
        "decode_tok_s": rate(args.output_len - 1, m["single"]["median_e2el_ms"] - prefill_ms),
        **{f"c{c}_tok_s": m[f"c{c}"]["output_throughput"] for c in args.concurrency},
        "pp_tok_s": rate(args.input_len, prefill_ms),
        "pp_batch_tok_s": m["pp_batch"]["input_throughput"],
        "startup_s": run["startup_s"],
        "idle_rss_mib": run["idle_rss_mib"],
    }
    return {k: None if v is None else round(v, 2) for k, v in out.items()}


def plan(args: argparse.Namespace, repeat: int) -> list[tuple[str, int, int, int, int]]:
    """(name, requests, in flight, max_tokens, seed) of each measurement of one repeat, warm-up first."""
    seed = args.seed + SEEDS_PER_REPEAT * repeat
    steps = [
        ("warmup", 1, 1, args.output_len),
        ("pp_single", args.single_requests, 1, 1),
        ("single", args.single_requests, 1, args.output_len),
        *((f"c{c}", c, c, args.output_len) for c in args.concurrency),
        ("pp_batch", args.pp_requests, args.pp_requests, 1),
    ]
    return [(name, n, conc, tokens, seed + k) for k, (name, n, conc, tokens) in enumerate(steps)]


def bench_args(
    args: argparse.Namespace, base_url: str, requests: int, in_flight: int, max_tokens: int, seed: int
) -> argparse.Namespace:
    """`ember bench serve`'s flags for one measurement, parsed by its own parser so its defaults apply."""
    parser = argparse.ArgumentParser()
    add_serve_bench_args(parser)
    return parser.parse_args(
        [
            "--base-url",
            base_url,
            "--dataset",
            "fixed",
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(max_tokens),
            "--num-prompts",
            str(requests),
            "--max-concurrency",
            str(in_flight),
            "--seed",
            str(seed),
            "--temperature",
            "0",
            "--request-timeout",
            str(args.request_timeout),
            "--disable-tqdm",
        ]
    )


def check(name: str, summary: dict[str, Any], requests: int, max_tokens: int) -> list[str]:
    """Failed requests are an error; a token count other than requested (an engine stopping early, or one
    that reports no usage and merged tokens into chunks) is a warning, kept in the result."""
    if summary["failed"]:
        raise RuntimeError(f"{name}: {summary['failed']} of {requests} requests failed: {summary['errors']}")
    expected = requests * max_tokens
    if summary["total_output_tokens"] != expected:
        return [f"{name}: {summary['total_output_tokens']} output tokens, {expected} requested"]
    return []


# ---- servers over HTTP ----------------------------------------------------------------------------


def llama_server_command(args: argparse.Namespace, gguf: str, host: str, port: int) -> list[str]:
    """As many slots as the largest measurement has requests in flight, sharing one KV cache (`--kv-unified`,
    like Ember's paged cache) that holds all of them at full length.

    Without --kv-unified llama.cpp gives each slot its own n_ctx / slots, padded to 256, and a request
    that fills its slot to the last cell (128 + 128 in 256) gets its context shifted (`truncated = 1`).
    """
    slots = max(*args.concurrency, args.pp_requests)
    return [
        args.llama_server,
        "-m",
        gguf,
        "--host",
        host,
        "--port",
        str(port),
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "-np",
        str(slots),
        "--kv-unified",
        "-c",
        str(slots * (args.input_len + args.output_len)),
        *shlex.split(args.llama_server_args),
    ]


def run_server(args: argparse.Namespace, engine: str, gguf: str, repeat: int) -> dict[str, Any]:
    """Spawn a fresh server, time its start-up, send one request, read its idle RSS, then measure."""
    host = "127.0.0.1"
    port = free_port(host)
    if engine == "ember":
        cmd = server_command(args.model, host, port, shlex.split(args.ember_args))
    else:
        cmd = llama_server_command(args, gguf, host, port)
    run: dict[str, Any] = {"loadavg_before": load_average(), "server_command": cmd, "warnings": [], "measurements": {}}
    with ServerProcess(cmd, host, port) as server:
        try:
            run["startup_s"] = round(server.wait_ready(args.timeout), 3)
            for name, requests, in_flight, max_tokens, seed in plan(args, repeat):
                summary = asyncio.run(
                    bench_serve.benchmark(bench_args(args, server.url, requests, in_flight, max_tokens, seed))
                )["results"]
                run["warnings"] += check(name, summary, requests, max_tokens)
                run["measurements"][name] = {k: summary[k] for k in KEPT}
                if name == "warmup":  # "idle": after start-up and one request, with nothing running
                    time.sleep(args.idle_wait)
                    run["idle_rss_mib"] = round(rss_mib(process_tree(server.proc.pid)), 1)
            run["rss_end_mib"] = round(rss_mib(process_tree(server.proc.pid)), 1)
        except (RuntimeError, ValueError) as e:  # a failed measurement, or no model listed: recorded, not fatal
            run["error"] = str(e)
    if "error" in run:  # the whole log, shutdown included, as before
        run["log_tail"] = server.log_tail()
    return run


# ---- HF transformers, in a fresh process per repeat -------------------------------------------------


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Greedy generation of exactly `new_tokens` per prompt (min_new_tokens plays ignore_eos); returns seconds.

    Prompts all have `--input-len` tokens, so a batch needs no padding and a static batch wastes nothing.
    """
    from transformers import GenerationConfig

    ids = torch.tensor(prompts)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=model.generation_config.eos_token_id,
    )
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return time.perf_counter() - start


def hf_measure(model: Any, prompts: list[list[int]], in_flight: int, new_tokens: int) -> dict[str, Any]:
    """The prompts one `generate` call at a time, or all in one batch; fills the summary keys that `derive`
    reads from `ember bench serve` (E2E of a request = its generate call), so both kinds of engine are
    computed alike."""
    if in_flight == 1:
        e2e = [hf_generate(model, [prompt], new_tokens) for prompt in prompts]
    else:
        e2e = [hf_generate(model, prompts, new_tokens)] * len(prompts)
    duration = sum(e2e) if in_flight == 1 else e2e[0]
    tokens_in, tokens_out = len(prompts) * len(prompts[0]), len(prompts) * new_tokens
    e2e_ms = sorted(t * 1e3 for t in e2e)
    return {
        "completed": len(prompts),
        "failed": 0,
        "duration_s": round(duration, 6),
        "total_input_tokens": tokens_in,
        "total_output_tokens": tokens_out,
        "input_throughput": round(tokens_in / duration, 3),
        "output_throughput": round(tokens_out / duration, 3),
        "median_e2el_ms": round(statistics.median(e2e_ms), 3),
        "p99_e2el_ms": round(percentile(e2e_ms, 99), 3),
        "median_ttft_ms": None,
        "median_tpot_ms": None,
        "errors": [],
    }


def hf_worker(args: argparse.Namespace, gguf: str, repeat: int, spawned: float) -> dict[str, Any]:
    """Runs in a fresh process, so that start-up and resident memory count as they do for a server process.

    startup_s is spawn to loaded: `interpreter_s` (a new interpreter importing this script, torch and
    Ember's modules with it), `import_s` (transformers) and `load_s` (reading the GGUF and dequantizing
    it to float32). `rss_before_load_mib` is what this process held before the model, so the model's
    own share of `idle_rss_mib` can be told apart from the imports'.
    """
    started = time.time()
    import transformers

    imported = time.time()
    before_load = rss_mib([os.getpid()])
    model = load_hf_model(gguf, "auto", torch.float32, "cpu")
    loaded = time.time()
    run: dict[str, Any] = {
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "startup_s": round(loaded - spawned, 3),
        "interpreter_s": round(started - spawned, 3),
        "import_s": round(imported - started, 3),
        "load_s": round(loaded - imported, 3),
        "rss_before_load_mib": round(before_load, 1),
        "measurements": {},
    }
    for name, requests, in_flight, max_tokens, seed in plan(args, repeat):
        specs = make_requests(bench_args(args, "http://unused", requests, in_flight, max_tokens, seed))
        run["measurements"][name] = hf_measure(model, [s.prompt for s in specs], in_flight, max_tokens)
        if name == "warmup":
            gc.collect()
            time.sleep(args.idle_wait)
            run["idle_rss_mib"] = round(rss_mib([os.getpid()]), 1)
    run["rss_end_mib"] = round(rss_mib([os.getpid()]), 1)
    return run


def run_hf(args: argparse.Namespace, gguf: str, repeat: int) -> dict[str, Any]:
    run: dict[str, Any] = {"loadavg_before": load_average(), "warnings": []}
    # Inherited by the worker, where tqdm reads it on import: transformers' GGUF conversion draws a progress bar.
    os.environ["TQDM_DISABLE"] = "1"
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        try:
            run.update(pool.submit(hf_worker, args, gguf, repeat, time.time()).result())
        except Exception as e:  # noqa: BLE001 - one failed repeat is recorded; the other engines go on
            run["error"] = f"{type(e).__name__}: {e}"
    return run


# ---- reporting ------------------------------------------------------------------------------------


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r["columns"][key] for r in runs if "error" not in r and r["columns"][key] is not None]
    return round(statistics.median(values), 2) if values else None


def print_table(args: argparse.Namespace, results: dict[str, Any]) -> None:
    cols = columns(args)
    width = max(14, *(len(h) + 2 for _, h in cols))
    print(f"{'':<10}" + "".join(f"{h:>{width}}" for _, h in cols))
    for engine, res in results.items():
        cells = ("n/a" if v is None else f"{v:.2f}" for v in (res["median"][k] for k, _ in cols))
        print(f"{engine:<10}" + "".join(f"{c:>{width}}" for c in cells))


def write_chart(path: str, args: argparse.Namespace, results: dict[str, Any], title: str) -> None:
    """One panel per column, one bar per engine. Optional: without matplotlib there is no chart."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = columns(args)
    per_row = 4
    rows = -(-len(cols) // per_row)
    fig, axes = plt.subplots(rows, per_row, figsize=(3.2 * per_row, 2.8 * rows), squeeze=False)
    engines = list(results)
    for ax, (key, header) in zip(axes.flat, cols):
        values = [results[e]["median"][key] or 0.0 for e in engines]
        bars = ax.bar(engines, values, color=[COLORS[e] for e in engines])
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.margins(y=0.15)
        ax.set_title(header + (" (lower is better)" if key in ("startup_s", "idle_rss_mib") else ""), fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(cols) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def llama_server_version(path: str) -> str | None:
    """What `llama-server --version` prints (its build number and commit), for the record."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return " ".join((out.stdout + out.stderr).split()) or None


# ---- command line -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file every engine loads (default: the default model's)")
    p.add_argument(
        "--synthetic",
        choices=sorted(SHAPES),
        default=None,
        help="instead of --model: a random-weight file of this shape in llama.cpp's Q4_K_M mix, written once "
        "into ~/.cache/ember/bench (ember.bench.gguf_files)",
    )
    p.add_argument("--repeats", type=int, default=3, help="fresh starts of each engine; the table shows medians")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random token ids)")
    p.add_argument("--output-len", type=int, default=128, help="new tokens per request (ignore_eos)")
    p.add_argument(
        "--single-requests",
        type=int,
        default=3,
        help="requests sent one after another for the single-stream and pp columns",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[16, 32],
        help="requests sent at once for the cN columns, one measurement per value",
    )
    p.add_argument(
        "--pp-requests",
        type=int,
        default=32,
        help="prompts sent at once with max_tokens=1 for the batched prompt-processing column",
    )
    p.add_argument("--seed", type=int, default=0, help="base seed of the prompts' token ids")
    p.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="llama-server's -t and -tb (default: torch's thread count, which Ember and HF use)",
    )
    p.add_argument("--llama-server", default=None, metavar="PATH", help="also run llama.cpp's llama-server binary")
    p.add_argument(
        "--llama-server-args", default="", help="more llama-server flags, one string: --llama-server-args='-fa on'"
    )
    p.add_argument(
        "--ember-args", default="", help="more `ember serve` flags, one string: --ember-args='--kv-cache-memory 1'"
    )
    p.add_argument("--hf", action="store_true", help="also run HF transformers (GGUF dequantized to float32)")
    p.add_argument(
        "--idle-wait", type=float, default=2.0, help="seconds after the warm-up request before the idle RSS is read"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a server may take to become ready")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/cpu-<date>.json); "
        "a PNG chart goes next to it if matplotlib is installed",
    )
    args = p.parse_args(argv)
    counts = [
        args.repeats,
        args.input_len,
        args.output_len,
        args.single_requests,
        args.pp_requests,
        args.threads,
        *args.concurrency,
    ]
    if min(counts) < 1:
        p.error("--repeats, lengths, request counts, --concurrency and --threads must be >= 1")
    if args.output_len < 2:
        p.error("--output-len must be >= 2 (decode tok/s needs a second token)")
    if args.synthetic is not None:
        if args.model is not None:
            p.error("--synthetic and --model exclude each other")
        args.model = cached_model(SHAPES[args.synthetic], args.synthetic)
    if args.llama_server is not None and not os.access(args.llama_server, os.X_OK):
        p.error(f"--llama-server {args.llama_server!r} is not an executable file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = {**machine_info(), **cpu_info()}
    gguf = resolve_model(args.model)
    if not gguf.endswith(".gguf"):
        raise SystemExit("error: --model must be a .gguf file, the one format all three engines load")
    runners: dict[str, Callable[[int], dict[str, Any]]] = {"ember": lambda r: run_server(args, "ember", gguf, r)}
    if args.llama_server:
        runners["llama.cpp"] = lambda r: run_server(args, "llama.cpp", gguf, r)
    if args.hf:
        runners["hf"] = lambda r: run_hf(args, gguf, r)
    runs: dict[str, list[dict[str, Any]]] = {engine: [] for engine in runners}
    for repeat in range(args.repeats):
        for engine, runner in runners.items():
            print(f"repeat {repeat + 1}/{args.repeats}: {engine}", flush=True)
            run = runner(repeat)
            if "error" not in run:
                run["columns"] = derive(args, run)
            for warning in run["warnings"]:
                print(f"WARNING: {engine}: {warning}")
            if "error" in run:
                print(f"ERROR: {engine}: {run['error']}" + "".join(f"\n  {line}" for line in run.get("log_tail", [])))
            runs[engine].append(run)
    results = {
        engine: {
            "median": {key: median_of(engine_runs, key) for key, _ in columns(args)},
            "failed_runs": sum("error" in r for r in engine_runs),
            "runs": engine_runs,
        }
        for engine, engine_runs in runs.items()
    }
    print_table(args, results)

    out = args.out or os.path.join(RESULTS_DIR, f"cpu-{today()}.json")
    config = {
        **vars(args),
        "gguf": gguf,
        "columns": dict(columns(args)),
        "llama_server_version": llama_server_version(args.llama_server) if args.llama_server else None,
    }
    write_json(
        out,
        {
            "benchmark": "cpu",
            "date": today(),
            "machine": machine,
            "command": sys.argv,
            "config": config,
            "results": results,
        },
    )
    write_chart(
        os.path.splitext(out)[0] + ".png",
        args,
        results,
        f"{model_short_name(args.model)}, {args.input_len}-token prompts, {args.output_len} new tokens, "
        f"median of {args.repeats}, {machine['cpu']} ({machine['cores']} cores)",
    )
    print(f"wrote {out}")
    return 0 if all(r["failed_runs"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
