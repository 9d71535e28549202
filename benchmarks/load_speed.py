"""Load speed: seconds and GB/s of file for reading a GGUF checkpoint into Ember's in-memory weights.

Timed: `ember.model.loader.load_model_files` plus exhausting its weight iterator, i.e. everything the
engine core does with the file before it builds layers (metadata and vocabulary parse, every tensor
decoded, quantized types kept quantized, q/k rows un-permuted). The page cache is warm: one untimed
read first, then the median of --repeat runs. Files:

- the default model (SmolLM2-135M-Instruct Q4_1);
- a random-weight GGUF of Qwen2.5-1.5B's shape (1.54B parameters) with llama.cpp's Q4_K_M type mix
  (ember.bench.gguf_files.q4_k_m_type), written once into --cache-dir.

--llm also times `LLM()` construction for the default model on CPU (in-process engine): reading
plus building the model's CPU kernels' weight layouts and the KV cache.

    python benchmarks/load_speed.py --repeat 5 --llm
    python benchmarks/load_speed.py --repeat 1 --layers 2      # a quick check that it runs
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from ember.bench.gguf_files import QWEN25_1_5B, ModelShape, write_model
from ember.bench.machine import load_average
from ember.config import EngineArgs
from ember.model.files import model_path
from ember.model.loader import load_model_files


def read_weights(path: str) -> None:
    files = load_model_files(EngineArgs(model=path))
    for _ in files.weights():
        pass


def build_llm(path: str) -> None:
    from ember import LLM

    LLM(path, device="cpu", kv_cache_memory=0.05, max_model_len=512, engine_process=False)


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
    median = statistics.median(wall)
    return {"file": path, "file_gb": round(size / 1e9, 4), "seconds": [round(s, 4) for s in wall],
            "median_s": round(median, 4), "gb_per_s": round(size / 1e9 / median, 3),
            "cpu_seconds": [round(s, 4) for s in cpu], "median_cpu_s": round(statistics.median(cpu), 4),
            "loadavg_after": load_average()}


def synthetic_file(cache_dir: str, shape: ModelShape) -> str:
    path = os.path.join(cache_dir, f"qwen2.5-1.5b-shape-q4_k_m-random-{shape.layers}l.gguf")
    if not os.path.exists(path):
        os.makedirs(cache_dir, exist_ok=True)
        print(f"writing {path} ...", flush=True)
        write_model(path + ".partial", shape)
        os.replace(path + ".partial", path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per file (median reported)")
    parser.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "ember", "bench"),
                        help="where the synthetic GGUF file is written once and reused")
    parser.add_argument("--layers", type=int, default=QWEN25_1_5B.layers,
                        help="layers of the synthetic model (fewer for a quick check; the result is then not the 1.5B figure)")
    parser.add_argument("--llm", action="store_true", help="also time LLM() construction for the default model")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/load-speed-cpu-<date>.json)")
    args = parser.parse_args()

    machine = machine_info()
    shape = dataclasses.replace(QWEN25_1_5B, layers=args.layers)
    default_path, _ = model_path(EngineArgs())
    runs = {"default model: read weights": timed(read_weights, default_path, args.repeat),
            f"Qwen2.5-1.5B shape Q4_K_M ({args.layers} layers): read weights":
                timed(read_weights, synthetic_file(args.cache_dir, shape), args.repeat)}
    if args.llm:
        runs["default model: LLM() on CPU"] = timed(build_llm, default_path, args.repeat)

    print(f"{'what':<58} {'seconds':>8} {'CPU s':>7} {'file GB':>8} {'GB/s':>6}")
    for name, r in runs.items():
        print(f"{name:<58} {r['median_s']:>8.3f} {r['median_cpu_s']:>7.3f} {r['file_gb']:>8.3f} {r['gb_per_s']:>6.2f}")
    out = args.out or os.path.join(RESULTS_DIR, f"load-speed-cpu-{today()}.json")
    config = {**vars(args), "warm_page_cache": True, "synthetic_shape": dataclasses.asdict(shape)}
    write_json(out, {"benchmark": "load_speed", "date": today(), "machine": machine, "command": " ".join(sys.argv),
                     "config": config, "results": runs})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
