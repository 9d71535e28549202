"""Where a CPU decode step's time goes: per-op CPU time, op count and process CPU time per step.

For each batch size, `--batch-sizes` requests of `--prompt-len` random token ids generate
`--steps` + 1 tokens each (greedy, `ignore_eos`) in one engine in this process; the same requests
with one token each (prefill only) are subtracted, so every number is per decode step:

- `cpu_ms`: process CPU time (`time.process_time`, every thread of the process), which unlike
  wall time stays meaningful on a shared machine, though cache and memory contention still
  inflate it; compare runs taken under similar `loadavg`;
- `wall_ms`: the same in wall time (meaningful on a quiet machine only);
- `ops`: aten operator calls (nested ones included) and the top operators by self CPU time, from
  `torch.profiler` (whose own overhead inflates the small operators' times).

    python benchmarks/cpu_step_profile.py                       # default model, batch 1 and 16
    OMP_NUM_THREADS=1 python benchmarks/cpu_step_profile.py --batch-sizes 1
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import Counter
from typing import Any

from torch.profiler import ProfilerActivity, profile

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from ember.llm import LLM
from ember.sampling.params import SamplingParams

TOP_OPS = 15


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the default SmolLM2 GGUF)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="decode steps measured per batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/cpu-step-profile-<date>.json)")
    return p.parse_args(argv)


def _timed(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(wall s, CPU s) of generating `tokens` tokens for every prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - wall, time.process_time() - cpu


def _profiled(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[Counter, Counter]:
    """(self CPU µs, calls) per aten operator while generating `tokens` tokens for every prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    events = prof.key_averages()
    return Counter({e.key: e.self_cpu_time_total for e in events}), Counter({e.key: e.count for e in events})


def measure(llm: LLM, batch: int, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """Per decode step at this batch size: the decode run minus a prefill-only run of fresh prompts
    (fresh so that no prefix-cache hit shortens either)."""

    def prompts() -> list[list[int]]:
        return [[rng.randrange(100, 10000) for _ in range(args.prompt_len)] for _ in range(batch)]

    _timed(llm, prompts(), args.steps + 1)  # warm-up: first-use allocations and kernel set-up
    prefill_wall, prefill_cpu = _timed(llm, prompts(), 1)
    wall, cpu = _timed(llm, prompts(), args.steps + 1)
    base_us, base_calls = _profiled(llm, prompts(), 1)
    us, calls = _profiled(llm, prompts(), args.steps + 1)
    us.subtract(base_us)
    calls.subtract(base_calls)
    n = args.steps
    top = [
        {"op": op, "cpu_ms": round(t / n / 1e3, 3), "calls": round(calls[op] / n, 1)}
        for op, t in us.most_common(TOP_OPS)
    ]
    return {
        "batch": batch,
        "loadavg": os.getloadavg(),
        "wall_ms": round((wall - prefill_wall) / n * 1e3, 2),
        "cpu_ms": round((cpu - prefill_cpu) / n * 1e3, 2),
        "ops": round(sum(calls.values()) / n),
        "profiled_cpu_ms": round(sum(us.values()) / n / 1e3, 2),
        "top_ops": top,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()
    llm = LLM(args.model, engine_process=False)  # in this process: process_time covers the engine's work
    rng = random.Random(args.seed)
    results = []
    for batch in args.batch_sizes:
        r = measure(llm, batch, args, rng)
        results.append(r)
        print(
            f"batch {batch} (load {r['loadavg'][0]:.1f}): {r['cpu_ms']} CPU ms, {r['wall_ms']} wall ms, "
            f"{r['ops']} aten ops per step",
            flush=True,
        )
        for row in r["top_ops"]:
            print(f"  {row['cpu_ms']:8.3f} ms  {row['calls']:7.1f} calls  {row['op']}")
    ready = llm.llm_engine.ready
    out = args.out or os.path.join(RESULTS_DIR, f"cpu-step-profile-{today()}.json")
    write_json(
        out,
        {
            "benchmark": "cpu_step_profile",
            "date": today(),
            "machine": machine,
            "command": sys.argv,
            "config": vars(args),
            "model": ready.description,
            "results": results,
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
