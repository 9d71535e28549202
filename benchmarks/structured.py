"""Structured output cost: grammar compile times, per-step mask time, and constrained vs free throughput.

Three measurements, one table and one JSON file:

1. compile: the 20 test schemas (tests/schemas.py), each compiled cold (a new llguidance matcher) and
   fetched from the core's cache (`GrammarManager.matcher`: source, lookup, copy); medians in ms.
2. masks: one step's bitmask for N constrained requests (matchers at different points of their
   schemas, each advanced by a random allowed token per step), filled as the core fills it; median
   and p99 ms per step. This is CPU work; the throughput runs show whether the GPU waits for it.
3. throughput: N requests at once, each with a JSON schema, then the same N requests without one,
   each run to exactly the length its constrained twin reached (`ignore_eos`), in the same engine.
   Constrained requests mostly end early (the JSON closes), so an unmatched comparison would set a
   batch that empties against a full one and measure occupancy, not the constraint's cost (the first
   version of this benchmark reported 64% on the CPU that way, with the same per-step time). Pairs
   are repeated (`--repeats`) and interleaved, so a load change on a shared machine hits both sides;
   each run records the load average. Prefix caching is off, so every run computes its prompts.
   On CUDA each run also reports the GPU's idle time between steps and its wait for masks inside
   steps (`gpu_mask_wait_s`: from the forward's end to the masks' arrival), from the core's stats.

    python benchmarks/structured.py                  # CPU: default model, 16 concurrent requests
    python benchmarks/structured.py --mode h200 --tokenizer DIR   # Qwen3-0.6B shape, random weights, 256
    python benchmarks/structured.py --tiny           # a seconds-long smoke run

The H200 mode has random weights; `--tokenizer` gives the grammars a real vocabulary (an HF directory
with tokenizer.json, e.g. Qwen3's). Without it they see the default model's vocabulary (49,152
tokens, written out as a tokenizer.json) padded to Qwen's 151,936 logits, so the masks cover a third
of a real Qwen vocabulary; either way every step computes and applies a mask for every constrained
request. The whole run stops itself after `--time-limit` seconds (default 210 on h200), writing what
it has measured so far.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a script: make `benchmarks.common` and the test schemas importable
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from schemas import SCHEMAS  # noqa: E402 - after the sys.path lines above

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json  # noqa: E402 - after the sys.path lines above
from benchmarks.step_profile import print_profile, profile_steps  # noqa: E402 - after the sys.path lines above
from ember import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402 - after the sys.path lines above
from ember.config import EngineArgs, LoadConfig  # noqa: E402 - after the sys.path lines above
from ember.core.grammar import GrammarManager  # noqa: E402 - after the sys.path lines above
from ember.model.files import load_model_info  # noqa: E402 - after the sys.path lines above

QWEN3_CONFIG = os.path.join(ROOT, "benchmarks", "configs", "qwen3-0.6b")
# Both runs sample, so both compute full logits. No seeds: a seeded row draws its noise with its own
# generator, one small kernel per row per step, host work that would hide the masks' cost at 256 rows.
TEMPERATURE = 0.6


class Deadline:
    """The run's time limit: phases ask how much is left; at the limit a watchdog reports what was
    measured so far (`report`) and ends the process (exit 124), whatever is running."""

    def __init__(self, seconds: float, report: Callable[[], None]) -> None:
        self.end = time.monotonic() + seconds
        self._report = report
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return self.end - time.monotonic()

    def _expire(self) -> None:
        print("time limit reached: the results so far", flush=True)
        self._report()
        os._exit(124)

    def cancel(self) -> None:
        self._timer.cancel()


def _ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 4)


def _p99_ms(seconds: list[float]) -> float:
    return round(float(np.percentile(seconds, 99)) * 1e3, 4)


def bench_compile(load: LoadConfig, vocab_size: int, schemas: list[dict]) -> dict[str, Any]:
    manager = GrammarManager(load, vocab_size)
    manager.matcher(StructuredOutputsParams(regex="warm"))  # waits for the vocabulary
    cold, cached = [], []
    for schema in schemas:
        params = StructuredOutputsParams(json=schema)
        start = time.perf_counter()
        manager.matcher(params)  # first sight of this source: compiled
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        manager.matcher(params)
        cached.append(time.perf_counter() - start)
    manager.shutdown()
    return {
        "schemas": len(schemas),
        "cold_median_ms": _ms(cold),
        "cold_max_ms": round(max(cold) * 1e3, 3),
        "cached_median_ms": _ms(cached),
    }


def bench_masks(load: LoadConfig, vocab_size: int, counts: list[int], steps: int, deadline: Deadline) -> dict[str, Any]:
    """Each step: fill the masks, then advance every matcher by a random allowed token."""
    manager = GrammarManager(load, vocab_size)
    rng = np.random.default_rng(0)
    median, p99 = {}, {}
    for n in counts:
        matchers = [manager.matcher(StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)])) for i in range(n)]
        times = []
        for _ in range(steps):
            if deadline.left() < 10:
                break
            start = time.perf_counter()
            bitmask = manager.start_masks(matchers).bitmask.result()
            times.append(time.perf_counter() - start)
            allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab_size, bitorder="little")
            for row, m in enumerate(matchers):
                if not m.is_stopped():
                    m.consume_token(int(rng.choice(np.flatnonzero(allowed[row]))))
        if times:
            median[str(n)], p99[str(n)] = _ms(times), _p99_ms(times)
    manager.shutdown()
    return {"steps": steps, "median_ms_by_requests": median, "p99_ms_by_requests": p99}


def _run(llm: LLM, prompts: list[Any], params: list[SamplingParams]) -> tuple[dict[str, Any], list[Any]]:
    engine = llm.llm_engine
    load = os.getloadavg()[0]
    before = engine.scheduler_stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = engine.scheduler_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = after.num_steps - before.num_steps
    row = {
        "requests": len(prompts),
        "output_tokens": tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tok_per_s": round(tokens / elapsed, 1),
        "steps": steps,
        "loadavg_1m_before": round(load, 2),
    }
    if engine.ready.device.startswith("cuda"):
        for name, key in (
            ("gpu_idle_between_steps_s", "gpu_idle_s"),
            ("gpu_busy_in_steps_s", "gpu_busy_s"),
            ("gpu_mask_wait_s", "gpu_mask_wait_s"),
        ):
            row[name] = round(getattr(after, key) - getattr(before, key), 4)
        row["gpu_idle_per_step_ms"] = round(row["gpu_idle_between_steps_s"] * 1e3 / max(steps, 1), 3)
        row["gpu_mask_wait_per_step_ms"] = round(row["gpu_mask_wait_s"] * 1e3 / max(steps, 1), 3)
    return row, outs


def _constrained(n: int, max_tokens: int) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=TEMPERATURE,
            max_tokens=max_tokens,
            structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]),
        )
        for i in range(n)
    ]


def _free(lengths: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=TEMPERATURE, max_tokens=n, ignore_eos=True) for n in lengths]


def bench_throughput(
    llm: LLM, prompts: list[Any], max_tokens: int, repeats: int, deadline: Deadline, out: dict[str, Any]
) -> None:
    """Pairs of runs: the constrained requests, then the same requests unconstrained at the lengths
    they reached, written into `out` as each pair ends (so that the time limit keeps them). A pair is
    started only when the last one would fit in the time left."""
    # Both kinds at full batch size, a few tokens each: compiles the sampler's kernels and sizes the
    # allocator's caches. Warming on 4 requests left the first 16-request constrained run at a third
    # of the others' speed, twice in a row.
    _run(llm, prompts, _constrained(len(prompts), 8))
    _run(llm, prompts, _free([8] * len(prompts)))
    pairs: list[dict[str, Any]] = []
    out["pairs"] = pairs
    pair_s = 0.0
    while len(pairs) < repeats and deadline.left() > 1.5 * pair_s + 5:
        start = time.monotonic()
        constrained, outs = _run(llm, prompts, _constrained(len(prompts), max_tokens))
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
        constrained["ended_by_grammar"] = len(finished)
        constrained["finished_not_json"] = sum(not _is_json(o.text) for o in finished)  # must be 0
        free, _ = _run(llm, prompts, _free(lengths))
        ratio = round(constrained["output_tok_per_s"] / free["output_tok_per_s"], 3)
        pairs.append({"json_schema": constrained, "unconstrained": free, "ratio": ratio})
        out.update(_summary(pairs))
        pair_s = time.monotonic() - start


def profile_decode(llm: LLM, prompts: list[Any], params: list[SamplingParams], steps: int) -> dict[str, Any]:
    """`steps` decode steps of the whole batch under the profiler, once every request has its first
    token (prefill outside the window); the requests are then aborted."""
    engine = llm.llm_engine
    ids = [f"profile-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    started: set[str] = set()
    while len(started) < len(ids) and engine.has_unfinished_requests():
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    result = profile_steps(engine.step, steps, torch.device(engine.ready.device))
    engine.abort_request(ids)
    return result


def _summary(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    def median(values: Any) -> float:
        return round(statistics.median(values), 3)

    return {
        "ratio_median": median(p["ratio"] for p in pairs),
        "ratio_min": min(p["ratio"] for p in pairs),
        "ratio_max": max(p["ratio"] for p in pairs),
        "json_schema_tok_per_s_median": median(p["json_schema"]["output_tok_per_s"] for p in pairs),
        "unconstrained_tok_per_s_median": median(p["unconstrained"]["output_tok_per_s"] for p in pairs),
    }


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _engine(mode: str, tokenizer_dir: str, concurrency: int, in_process: bool) -> tuple[EngineArgs, LLM]:
    common = {
        "max_model_len": 2048,
        "max_num_seqs": concurrency,
        "enable_prefix_caching": False,
        **({"engine_process": False} if in_process else {}),
    }
    if mode == "h200":
        kwargs = {
            "model": QWEN3_CONFIG,
            "load_format": "dummy",
            "tokenizer": tokenizer_dir,
            "device": "cuda",
            "dtype": "bfloat16",
            **common,
        }
    else:
        kwargs = {"device": "cpu", "dtype": "float32", "kv_cache_memory": 0.5, **common}
    return EngineArgs(**kwargs), LLM(**kwargs)


def _prompts(mode: str, llm: LLM, n: int) -> list[Any]:
    if mode == "h200":
        rng = random.Random(0)
        return [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(128)]} for _ in range(n)]
    tok = llm.get_tokenizer()
    return [
        tok.apply_chat_template([{"role": "user", "content": f"Answer in JSON for this schema: {s}"}])
        for s in (SCHEMAS[i % len(SCHEMAS)] for i in range(n))
    ]


def _table(results: dict[str, Any]) -> None:
    rows: list[tuple[str, Any]] = []
    if "compile" in results:
        c = results["compile"]
        rows += [
            ("compile, cold median (ms)", c["cold_median_ms"]),
            ("compile, cached median (ms)", c["cached_median_ms"]),
        ]
    if "masks" in results:
        m = results["masks"]
        for n, ms in m["median_ms_by_requests"].items():
            rows.append(
                (f"mask fill per step, {n} requests, median / p99 (ms)", f"{ms} / {m['p99_ms_by_requests'][n]}")
            )
    for i, pair in enumerate(results.get("throughput", {}).get("pairs", [])):
        for name in ("json_schema", "unconstrained"):
            row = pair[name]
            gpu = (
                f", GPU idle {row['gpu_idle_per_step_ms']} ms/step, mask wait {row['gpu_mask_wait_per_step_ms']}"
                f" ms/step"
                if "gpu_idle_per_step_ms" in row
                else ""
            )
            rows.append(
                (
                    f"run {i + 1} {name} tok/s ({row['requests']} req, load {row['loadavg_1m_before']}{gpu})",
                    row["output_tok_per_s"],
                )
            )
        rows.append((f"run {i + 1} json_schema / unconstrained", pair["ratio"]))
    t = results.get("throughput", {})
    if "ratio_median" in t:
        rows.append(("json_schema / unconstrained, median of runs", t["ratio_median"]))
    if not rows:
        print("nothing measured yet")
        return
    width = max(len(label) for label, _ in rows) + 2
    for label, value in rows:
        print(f"{label:<{width}} {value:>16}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["cpu", "h200"], default="cpu")
    p.add_argument("--tiny", action="store_true", help="a few schemas, requests and tokens: checks the script runs")
    p.add_argument("--requests", type=int, default=None, help="concurrent requests (default 16 on cpu, 256 on h200)")
    p.add_argument("--max-tokens", type=int, default=None, help="per request (default 64 on cpu, 256 on h200)")
    p.add_argument("--repeats", type=int, default=None, help="constrained/free pairs (default 3 on cpu, 2 on h200)")
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds for the whole run (default 210 on h200, 900 on cpu); stops with what it has",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="h200 mode: an HF directory with tokenizer.json for the grammars (default: the default "
        "model's vocabulary, written out)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="then profile this many decode steps of each kind by kernel (runs the engine in-process)",
    )
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/structured-<mode>-<date>.json)")
    a = p.parse_args()
    h200 = a.mode == "h200"
    requests = a.requests or (4 if a.tiny else 256 if h200 else 16)
    max_tokens = a.max_tokens or (8 if a.tiny else 256 if h200 else 64)
    repeats = a.repeats or (1 if a.tiny else 2 if h200 else 3)
    counts = [1, 4] if a.tiny else [1, 16, 64, 256]
    out = a.out or os.path.join(RESULTS_DIR, f"structured-{a.mode}{'-tiny' if a.tiny else ''}-{today()}.json")
    results: dict[str, Any] = {
        "mode": a.mode,
        "date": today(),
        "machine": machine_info(),
        "command": " ".join(sys.argv),
        "requests": requests,
        "max_tokens": max_tokens,
        "stopped_by_time_limit": True,
    }

    def report() -> None:
        _table(results)
        write_json(out, results)
        print(f"wrote {out}", flush=True)

    deadline = Deadline(a.time_limit or (210 if h200 else 900), report)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = a.tokenizer or scratch
        if a.tokenizer is None:
            default = load_model_info(EngineArgs().load_config()).tokenizer
            default.tok.save(os.path.join(scratch, "tokenizer.json"))
            write_json(os.path.join(scratch, "tokenizer_config.json"), {"eos_token": default.eos_token})
        args, llm = _engine(a.mode, tokenizer_dir, requests, in_process=a.profile_steps > 0)
        vocab = llm.llm_engine.ready.vocab_size
        # The target first: under the time limit, a slow start leaves the shorter measurements out.
        results["throughput"] = {}
        prompts = _prompts(a.mode, llm, requests)
        bench_throughput(llm, prompts, max_tokens, repeats, deadline, results["throughput"])
        if a.profile_steps:
            results["profile"] = {
                "json_schema": profile_decode(llm, prompts, _constrained(requests, max_tokens), a.profile_steps),
                "unconstrained": profile_decode(llm, prompts, _free([max_tokens] * requests), a.profile_steps),
            }
            for name, p in results["profile"].items():
                print_profile(p, f"{name} decode steps")
        llm.llm_engine.shutdown()
        results["masks"] = bench_masks(args.load_config(), vocab, counts, 3 if a.tiny else 32, deadline)
        results["compile"] = bench_compile(args.load_config(), vocab, SCHEMAS[:3] if a.tiny else SCHEMAS)
    deadline.cancel()
    results["stopped_by_time_limit"] = False
    report()


if __name__ == "__main__":
    main()
