"""Load speed: seconds and GB/s of file for reading a GGUF checkpoint into Ember's in-memory weights.

Timed: `ember.model.loader.load_model_files` plus exhausting its weight iterator, i.e. everything the
engine core does with the file before it builds layers (metadata and vocabulary parse, every tensor
decoded, quantized types kept quantized, q/k rows un-permuted). The page cache is warm: one untimed
read first, then the median of --repeat runs. Files:

- the default model (SmolLM2-135M-Instruct Q4_1);
- a random-weight GGUF of Qwen2.5-1.5B's shape (1.54B parameters) with llama.cpp's Q4_K_M type mix
  (ember.bench.gguf_files.q4_k_m_type), written once into --cache-dir.

--llm also times `LLM()` construction on CPU (in-process engine) for both files: reading plus
building the model, its CPU kernels' weight layouts and the KV cache. One more profiled construction
(cProfile, wall clock) splits it into phases: front end (tokenizer, metadata), read + decode (the
GGUF weight iterator), CPU packing (ember/ops/linear_cpu.py's layouts, fused q/k/v and gate/up) and the rest (layers,
KV cache, warm-up).

Wall seconds on a shared machine include waiting for a core, so every run also reports CPU seconds
(all threads) and GB of file per CPU second.

    python benchmarks/load_speed.py --repeat 5 --llm
    python benchmarks/load_speed.py --repeat 1 --layers 2      # a quick check that it runs
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import statistics
import sys
import time
from typing import Any

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from ember.bench.gguf_files import DEFAULT_CACHE_DIR, QWEN25_1_5B, cached_model
from ember.bench.machine import load_average
from ember.config import EngineArgs
from ember.model.files import model_path
from ember.model.loader import load_model_files


def read_weights(path: str) -> None:
    files = load_model_files(EngineArgs(model=path).load_config())
    for _ in files.weights():
        pass


def build_llm(path: str) -> None:
    from ember import LLM

    LLM(path, device="cpu", kv_cache_memory=0.05, max_model_len=512, engine_process=False)


# Phases of LLM() construction: functions (file suffix, name) whose cumulative profiled time adds up to
# each; none of them calls another's.
PHASES = {
    "front end (tokenizer, metadata)": [("ember/model/files.py", "load_model_info")],
    "read + decode weights": [("ember/model/gguf.py", "tensors")],
    "CPU packing": [("ember/ops/linear_cpu.py", "__init__"), ("ember/quant/formats.py", "concat_out")],
}


def llm_phases(path: str) -> dict[str, float]:
    """Seconds per phase of one profiled LLM() construction; "rest" is the remainder of the total."""
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.runcall(build_llm, path)
    total = time.perf_counter() - start
    stats = pstats.Stats(profile).stats  # (file, line, function) -> (calls, prim. calls, own s, cumulative s, callers)
    phases = {
        name: round(
            sum(
                ct
                for (file, _, fn), (_, _, _, ct, _) in stats.items()
                if any(file.endswith(suffix) and fn == want for suffix, want in funcs)
            ),
            4,
        )
        for name, funcs in PHASES.items()
    }
    return {
        **phases,
        "rest (layers, KV cache, warm-up)": round(total - sum(phases.values()), 4),
        "total (profiled)": round(total, 4),
    }


def timed(fn: Any, path: str, repeat: int) -> dict[str, Any]:
    """Wall and CPU seconds (all threads) of `repeat` runs after a warm-up run: on a shared machine
    the CPU seconds show what the work costs when the wall clock includes waiting for a core."""
    fn(path)  # warms the page cache (and imports)
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn(path)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    size = os.path.getsize(path)
    median, median_cpu = statistics.median(wall), statistics.median(cpu)
    return {
        "file": path,
        "file_gb": round(size / 1e9, 4),
        "seconds": [round(s, 4) for s in wall],
        "median_s": round(median, 4),
        "gb_per_s": round(size / 1e9 / median, 3),
        "cpu_seconds": [round(s, 4) for s in cpu],
        "median_cpu_s": round(median_cpu, 4),
        "gb_per_cpu_s": round(size / 1e9 / median_cpu, 3),
        "loadavg_after": load_average(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per file (median reported)")
    parser.add_argument(
        "--cache-dir",
        default=DEFAULT_CACHE_DIR,
        help="where the synthetic GGUF file is written once and reused",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=QWEN25_1_5B.layers,
        help="layers of the synthetic model (fewer for a quick check; the result is then not the 1.5B figure)",
    )
    parser.add_argument("--llm", action="store_true", help="also time LLM() construction for the default model")
    parser.add_argument(
        "--out", default=None, help="JSON path (default: benchmarks/results/load-speed-cpu-<date>.json)"
    )
    args = parser.parse_args()

    machine = machine_info()
    shape = dataclasses.replace(QWEN25_1_5B, layers=args.layers)
    default_path, _ = model_path(EngineArgs().load_config())
    files = {
        "default model": default_path,
        f"Qwen2.5-1.5B shape Q4_K_M ({args.layers} layers)": cached_model(shape, "qwen2.5-1.5b", args.cache_dir),
    }
    runs = {f"{name}: read weights": timed(read_weights, path, args.repeat) for name, path in files.items()}
    if args.llm:
        for name, path in files.items():
            runs[f"{name}: LLM() on CPU"] = {**timed(build_llm, path, args.repeat), "phases_s": llm_phases(path)}

    print(f"{'what':<58} {'seconds':>8} {'CPU s':>7} {'file GB':>8} {'GB/s':>6} {'GB/CPU-s':>9}")
    for name, r in runs.items():
        print(
            f"{name:<58} {r['median_s']:>8.3f} {r['median_cpu_s']:>7.3f} {r['file_gb']:>8.3f} {r['gb_per_s']:>6.2f}"
            f" {r['gb_per_cpu_s']:>9.2f}"
        )
        for phase, seconds in r.get("phases_s", {}).items():
            print(f"    {phase:<54} {seconds:>8.3f}")
    out = args.out or os.path.join(RESULTS_DIR, f"load-speed-cpu-{today()}.json")
    config = {**vars(args), "warm_page_cache": True, "synthetic_shape": dataclasses.asdict(shape)}
    write_json(
        out,
        {
            "benchmark": "load_speed",
            "date": today(),
            "machine": machine,
            "command": " ".join(sys.argv),
            "config": config,
            "results": runs,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
