"""One batch-1 decode step's native GEMVs with their weights coming from DRAM, in GB/s of weights read,
against a plain read of memory: where the CPU decode step's weight bandwidth goes.

The weights are random, in the shapes and native forms of the synthetic Qwen2-0.5B Q4_K_M GGUF
(`benchmarks/cpu.py --synthetic qwen2-0.5b`): 24 layers of fused qkv 1152 x 896 (int5, every other layer
Q8_0), o 896 x 896 (int5), gate/up 9728 x 896 (int5), down 896 x 4864 (Q6_K as two-level int8 groups of
16, every other layer Q4_K as two-level int4 with zeros), and the 151936 x 896 Q8_0 LM head: 409 MB, so
every call reads its weight from DRAM (L3 32 MiB). Each case is timed one row at a time, in bf16
arithmetic as NativeLinear runs it on AVX512_BF16 CPUs.

`--builds` compares kernel sources or compile flags (`DIR[:FLAG,FLAG]`, e.g. a copy of
ember/cpu_native/csrc with `-DPREFETCH_BYTES=8192`) in one process on the same weights, each round in a
random order, so a shared machine's drift falls on all of them alike. Medians over `--rounds`.

    python benchmarks/cpu_weight_stream.py
    python benchmarks/cpu_weight_stream.py --builds ember/cpu_native/csrc /tmp/old-csrc
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from ember.cpu_native.build import SOURCES, load
from ember.cpu_native.build import build as build_kernels

LAYERS, HIDDEN, INTER, VOCAB = 24, 896, 4864, 151936
READ_BYTES = 1 << 30


class Weight:
    """A random weight in a native form: kernel `kind` (q4, q5, q8), tensors (codes, scales[, zeros]),
    N x K, group, parameter mode (kernels.h's param: 1 float16, 2 two-level)."""

    def __init__(self, kind: str, tensors: tuple[torch.Tensor, ...], n: int, k: int, group: int, mode: int):
        self.kind, self.tensors, self.n, self.k, self.group, self.mode = kind, tensors, n, k, group, mode

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def _two_level(n: int, k: int, group: int, gen: torch.Generator) -> torch.Tensor:
    count = n * (k // group)
    codes = torch.randint(1, 64, (count,), dtype=torch.uint8, generator=gen)
    bases = (torch.rand(n * k // 256, generator=gen) * 1e-3).half().view(torch.uint8)
    return torch.cat([codes, torch.zeros(count & 1, dtype=torch.uint8), bases])


def _halves(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.rand(n, k // 32, generator=gen) * 0.01).half()


def int5(n: int, k: int, gen: torch.Generator) -> Weight:  # GGUF Q5_0
    codes = torch.randint(0, 256, (n, k // 32 * 20), dtype=torch.uint8, generator=gen)
    return Weight("q5", (codes, _halves(n, k, gen)), n, k, 32, 1)


def q8_0(n: int, k: int, gen: torch.Generator) -> Weight:
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    return Weight("q8", (codes, _halves(n, k, gen)), n, k, 32, 1)


def q6_k(n: int, k: int, gen: torch.Generator) -> Weight:
    codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=gen)
    return Weight("q8", (codes, _two_level(n, k, 16, gen)), n, k, 16, 2)


def q4_k(n: int, k: int, gen: torch.Generator) -> Weight:
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    return Weight("q4", (codes, _two_level(n, k, 32, gen), _two_level(n, k, 32, gen)), n, k, 32, 2)


def step_weights(gen: torch.Generator) -> dict[str, list[Weight]]:
    """The step's weights in call order, and its cases: the whole step and each kind of matrix."""
    layers = []
    for layer in range(LAYERS):
        qkv = q8_0 if layer % 2 else int5
        down = q4_k if layer % 2 else q6_k
        layers += [
            qkv(1152, HIDDEN, gen),
            int5(HIDDEN, HIDDEN, gen),
            int5(2 * INTER, HIDDEN, gen),
            down(HIDDEN, INTER, gen),
        ]
    head = q8_0(VOCAB, HIDDEN, gen)
    return {
        "step": [*layers, head],
        "gate_up int5": [w for w in layers if w.n == 2 * INTER],
        "down Q6_K": [w for w in layers if w.k == INTER and w.kind == "q8"],
        "down Q4_K": [w for w in layers if w.k == INTER and w.kind == "q4"],
        "head Q8_0": [head],
    }


def build(spec: str) -> ModuleType:
    """The kernels of `DIR[:FLAG,FLAG]` compiled with the engine's flags (cached by content)."""
    src, _, flags_text = spec.partition(":")
    return load(build_kernels(tuple(f for f in flags_text.split(",") if f), Path(src)))


def read_gbs(threads: int, repeats: int = 5) -> float:
    """GB/s of numpy summing a 1 GiB buffer, split into `threads` contiguous parts (numpy's reductions
    release the GIL)."""
    buf = np.ones(READ_BYTES // 8, dtype=np.uint64)
    parts = np.array_split(buf, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.add.reduce, parts))
            best = min(best, time.perf_counter() - start)
    return round(READ_BYTES / best / 1e9, 1)


def runner(module: ModuleType, weights: list[Weight], threads: int) -> Callable[[], None]:
    xs = {k: torch.randn(1, k) for k in {w.k for w in weights}}
    y = torch.empty(1, max(w.n for w in weights))
    calls = [(getattr(module, f"gemv_{w.kind}_bf16"), w, [t.data_ptr() for t in w.tensors]) for w in weights]

    def run() -> None:
        for fn, w, ptrs in calls:
            zeros = ptrs[2] if len(ptrs) > 2 else 0
            fn(xs[w.k].data_ptr(), ptrs[0], ptrs[1], zeros, y.data_ptr(), 1, w.k, w.n, w.group, threads, w.mode)

    return run


def measure(builds: list[str], rounds: int, threads: int) -> dict[str, Any]:
    modules = [build(spec) for spec in builds]
    cases = step_weights(torch.Generator().manual_seed(0))
    results: dict[str, Any] = {}
    for case, weights in cases.items():
        runs = [runner(m, weights, threads) for m in modules]
        times: list[list[float]] = [[] for _ in runs]
        for _ in range(rounds + 1):  # the first round warms up
            for i in random.sample(range(len(runs)), len(runs)):
                start = time.perf_counter()
                runs[i]()
                times[i].append(time.perf_counter() - start)
        nbytes = sum(w.nbytes for w in weights)
        results[case] = {"mbytes": round(nbytes / 1e6, 1)}
        for spec, ts in zip(builds, times):
            med = statistics.median(ts[1:])
            results[case][spec] = {"median_ms": round(med * 1e3, 3), "gbs": round(nbytes / med / 1e9, 1)}
            print(f"{case:13s} {spec:50s} {med * 1e3:8.3f} ms  {nbytes / med / 1e9:5.1f} GB/s", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--builds", nargs="+", default=[str(SOURCES)], help="kernel sources DIR[:FLAG,FLAG]")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/cpu-weight-stream-<date>.json)")
    args = p.parse_args(argv)
    info = machine_info()
    read = {f"{t} threads": read_gbs(t) for t in sorted({1, args.threads})}
    print(f"plain read (numpy sum of 1 GiB): {read}", flush=True)
    results = measure(args.builds, args.rounds, args.threads)
    out = args.out or os.path.join(RESULTS_DIR, f"cpu-weight-stream-{today()}.json")
    write_json(
        out,
        {
            "benchmark": "cpu_weight_stream",
            "date": today(),
            "machine": info,
            "command": sys.argv,
            "config": vars(args),
            "read_gbs": read,
            "results": results,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
