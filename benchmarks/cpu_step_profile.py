"""Where a CPU decode step's time goes: per-op CPU time, op count and process CPU time per step.

For each batch size, `--batch-sizes` requests of `--prompt-len` random token ids generate
`--steps` + 1 tokens each (greedy, `ignore_eos`) in one engine in this process, stepped here one step
at a time; the times are those of the `--steps` decode steps (the prefill steps before them left out),
and the operator profile subtracts a prefill-only run of as many requests. Every number is per decode
step:

- `cpu_ms`: process CPU time (`time.process_time`, every thread of the process), which unlike
  wall time stays meaningful on a shared machine, though cache and memory contention still
  inflate it; compare runs taken under similar `loadavg`;
- `wall_ms`: the same in wall time (meaningful on a quiet machine only);
- `ops`: aten operator calls (nested ones included) and the top operators by self CPU time, from
  `torch.profiler` (whose own overhead inflates the small operators' times);
- `native_ms`, `native_calls`: wall time in, and calls to, Ember's native CPU kernels (every function of
  ember/cpu_native's module, timed at the call), and `outside_native_ms` / `outside_native_cpu_ms`: the
  step's wall time, and the calling thread's CPU time (`time.thread_time`), outside them: the Python,
  torch ops and bookkeeping a step runs around its kernels (issue 30's target: <= 1 ms). The timer adds
  ~1 us a native call. Times are medians over the decode steps, operator figures means.

    python benchmarks/cpu_step_profile.py                       # default model, batch 1 and 16
    OMP_NUM_THREADS=1 python benchmarks/cpu_step_profile.py --batch-sizes 1
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch.profiler import ProfilerActivity, profile

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from ember.cpu_native import ops as native
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


class NativeClock:
    """The native kernel module behind a proxy that adds up the wall and calling-thread CPU time of
    every call, so a step's time splits into inside and outside the kernels. Installed before the model
    loads, so callers that keep a kernel function from load time keep the timed one."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module
        self.calls, self.wall, self.cpu = 0, 0.0, 0.0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._module, name)
        return self._timed(fn) if callable(fn) else fn

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args)
            finally:
                self.wall += time.perf_counter() - wall
                self.cpu += time.thread_time() - cpu
                self.calls += 1

        return call

    def reading(self) -> tuple[int, float, float]:
        return self.calls, self.wall, self.cpu


def install_clock() -> NativeClock | None:
    """Time the native kernels from here on; None where they are not used."""
    module = native.kernels() if native.available() else None
    if module is None:
        return None
    clock = NativeClock(module)
    native.kernels = lambda: clock  # type: ignore[assignment]  # ops.py reaches the module only through kernels()
    return clock


def _reading(clock: NativeClock | None) -> tuple[float, ...]:
    """Wall s, process and thread CPU s, native calls, native wall and CPU s, so far."""
    native_part = clock.reading() if clock else (0, 0.0, 0.0)
    return (time.perf_counter(), time.process_time(), time.thread_time(), *native_part)


def _decode_steps(llm: LLM, prompts: list[list[int]], steps: int, clock: NativeClock | None) -> dict[str, float]:
    """Generates `steps` + 1 tokens for every prompt, one engine step at a time; of the last `steps` steps
    (each a decode step of every prompt: the ones before prefill them), the median of each reading and of
    the times outside the kernels. Medians, because on a shared machine a few steps wait for the cores
    (one in ten took 2-10x the others, 2026-12-05) and move a mean by more than the overhead measured."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(None, prompt, params, final_only=True)
    readings = [_reading(clock)]
    while engine.has_unfinished_requests():
        engine.step()
        readings.append(_reading(clock))
    keys = ("wall", "cpu", "thread", "calls", "native", "native_cpu")
    deltas = [
        dict(zip(keys, (b - a for a, b in zip(r0, r1)))) for r0, r1 in zip(readings[-steps - 1 :], readings[-steps:])
    ]
    for d in deltas:
        d["outside"], d["outside_cpu"] = d["wall"] - d["native"], d["thread"] - d["native_cpu"]
    return {k: statistics.median(d[k] for d in deltas) for k in deltas[0]}


def _profiled(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[Counter, Counter]:
    """(self CPU µs, calls) per aten operator while generating `tokens` tokens for every prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    events = prof.key_averages()
    return Counter({e.key: e.self_cpu_time_total for e in events}), Counter({e.key: e.count for e in events})


def measure(
    llm: LLM, batch: int, args: argparse.Namespace, rng: random.Random, clock: NativeClock | None
) -> dict[str, Any]:
    """Per decode step at this batch size: times the decode steps alone; the operator profile is a decode
    run minus a prefill-only run. Fresh prompts each time, so that no prefix-cache hit shortens a run."""

    def prompts() -> list[list[int]]:
        return [[rng.randrange(100, 10000) for _ in range(args.prompt_len)] for _ in range(batch)]

    _decode_steps(llm, prompts(), args.steps, clock)  # warm-up: first-use allocations and kernel set-up
    step = _decode_steps(llm, prompts(), args.steps, clock)
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
        "wall_ms": round(step["wall"] * 1e3, 3),
        "cpu_ms": round(step["cpu"] * 1e3, 3),
        "native_calls": round(step["calls"], 1),
        "native_ms": round(step["native"] * 1e3, 3),
        "outside_native_ms": round(step["outside"] * 1e3, 3),
        "outside_native_cpu_ms": round(step["outside_cpu"] * 1e3, 3),
        "ops": round(sum(calls.values()) / n),
        "profiled_cpu_ms": round(sum(us.values()) / n / 1e3, 2),
        "top_ops": top,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()
    clock = install_clock()
    llm = LLM(args.model, engine_process=False)  # in this process: process_time covers the engine's work
    rng = random.Random(args.seed)
    results = []
    for batch in args.batch_sizes:
        r = measure(llm, batch, args, rng, clock)
        results.append(r)
        print(
            f"batch {batch} (load {r['loadavg'][0]:.1f}): {r['cpu_ms']} CPU ms, {r['wall_ms']} wall ms, "
            f"{r['native_ms']} ms in {r['native_calls']} native calls, outside them {r['outside_native_ms']} ms "
            f"({r['outside_native_cpu_ms']} CPU ms), {r['ops']} aten ops per step",
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
