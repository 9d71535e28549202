"""Structured output cost: grammar compile times, per-step mask time, and constrained vs free throughput.

Three measurements, one table and one JSON file:

1. compile: the 20 test schemas (tests/schemas.py), each compiled cold (a new llguidance matcher) and
   fetched from the core's cache (`GrammarManager.matcher`: source, lookup, copy); medians in ms.
2. masks: one step's bitmask for N constrained requests (matchers at different points of their
   schemas), filled as the core fills it while the GPU runs the forward; median ms per step.
3. throughput: the same requests with and without a JSON schema each, in the same run of one engine:
   output tokens/s, and on CUDA the GPU's idle time between steps from the core's stats.

    python benchmarks/structured.py                  # CPU: default model, 16 concurrent requests
    python benchmarks/structured.py --mode h200      # Qwen3-0.6B shape, random weights, 256 requests
    python benchmarks/structured.py --tiny           # a seconds-long smoke run

The H200 mode has random weights and no Qwen tokenizer here (no model hub): the grammars see the
default model's vocabulary (49,152 tokens, written out as a tokenizer.json) padded to Qwen's 151,936
logits, so its masks are computed over a third of a real Qwen vocabulary; every step still computes
and applies a mask for every constrained request.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a script: make `benchmarks.common` and the test schemas importable
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json  # noqa: E402
from ember import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from ember.config import EngineArgs  # noqa: E402
from ember.engine.grammar import GrammarManager  # noqa: E402
from ember.model.files import load_model_info  # noqa: E402
from schemas import SCHEMAS  # noqa: E402

QWEN3_CONFIG = os.path.join(ROOT, "benchmarks", "configs", "qwen3-0.6b")


def _ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 4)


def bench_compile(args: EngineArgs, vocab_size: int, schemas: list[dict]) -> dict[str, Any]:
    manager = GrammarManager(args, vocab_size)
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
    return {"schemas": len(schemas), "cold_median_ms": _ms(cold), "cold_max_ms": round(max(cold) * 1e3, 3),
            "cached_median_ms": _ms(cached)}


def bench_masks(args: EngineArgs, vocab_size: int, counts: list[int], steps: int) -> dict[str, Any]:
    """Each step: fill the masks, then advance every matcher by a random allowed token."""
    manager = GrammarManager(args, vocab_size)
    rng = random.Random(0)
    out = {}
    for n in counts:
        matchers = [manager.matcher(StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)])) for i in range(n)]
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            bitmask = manager.start_masks(matchers).result()
            times.append(time.perf_counter() - start)
            for row, m in enumerate(matchers):
                if m.is_stopped():
                    continue
                words = bitmask[row].numpy().view("uint32")
                allowed = [32 * w + b for w, word in enumerate(words) if word for b in range(32) if word >> b & 1]
                m.consume_token(rng.choice(allowed))
        out[str(n)] = _ms(times)
    manager.shutdown()
    return {"steps": steps, "median_ms_by_requests": out}


def bench_throughput(llm: LLM, prompts: list[Any], max_tokens: int) -> dict[str, Any]:
    engine = llm.llm_engine
    cuda = engine.ready.device.startswith("cuda")
    rows = {}
    for name in ("unconstrained", "json_schema"):
        params = [SamplingParams(temperature=0.6, seed=i, max_tokens=max_tokens, ignore_eos=name == "unconstrained",
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)])
                                 if name == "json_schema" else None) for i in range(len(prompts))]
        before = engine.scheduler_stats()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        after = engine.scheduler_stats()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
        row = {"requests": len(prompts), "output_tokens": tokens, "elapsed_s": round(elapsed, 3),
               "output_tok_per_s": round(tokens / elapsed, 1), "steps": after.num_steps - before.num_steps,
               "cut_by_max_tokens": sum(o.outputs[0].finish_reason == "length" for o in outs)}
        if name == "json_schema":  # every output that ended by itself must parse
            row["finished_not_json"] = sum(not _is_json(o.text) for o in finished)
        if cuda:
            row["gpu_idle_between_steps_s"] = round(after.gpu_idle_s - before.gpu_idle_s, 3)
            row["gpu_busy_in_steps_s"] = round(after.gpu_busy_s - before.gpu_busy_s, 3)
        rows[name] = row
    rows["ratio"] = round(rows["json_schema"]["output_tok_per_s"] / rows["unconstrained"]["output_tok_per_s"], 3)
    return rows


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _engine(mode: str, tokenizer_dir: str, concurrency: int) -> tuple[EngineArgs, LLM]:
    if mode == "h200":
        kwargs = {"model": QWEN3_CONFIG, "load_format": "dummy", "tokenizer": tokenizer_dir, "device": "cuda",
                  "dtype": "bfloat16", "max_model_len": 2048, "max_num_seqs": concurrency}
    else:
        kwargs = {"device": "cpu", "dtype": "float32", "max_model_len": 2048, "max_num_seqs": concurrency,
                  "kv_cache_memory": 0.5}
    return EngineArgs(**kwargs), LLM(**kwargs)


def _prompts(mode: str, llm: LLM, n: int) -> list[Any]:
    if mode == "h200":
        rng = random.Random(0)
        return [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(128)]} for _ in range(n)]
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": f"Answer in JSON for this schema: {s}"}])
            for s in (SCHEMAS[i % len(SCHEMAS)] for i in range(n))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["cpu", "h200"], default="cpu")
    p.add_argument("--tiny", action="store_true", help="a few schemas, requests and tokens: checks the script runs")
    p.add_argument("--requests", type=int, default=None, help="concurrent requests (default 16 on cpu, 256 on h200)")
    p.add_argument("--max-tokens", type=int, default=None, help="per request (default 64 on cpu, 256 on h200)")
    p.add_argument("--tokenizer", default=None,
                   help="h200 mode: an HF directory with tokenizer.json for the grammars (default: the default "
                        "model's vocabulary, written out)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/structured-<mode>-<date>.json)")
    a = p.parse_args()
    requests = a.requests or (4 if a.tiny else 16 if a.mode == "cpu" else 256)
    max_tokens = a.max_tokens or (8 if a.tiny else 64 if a.mode == "cpu" else 256)
    counts = [1, 4] if a.tiny else [1, 16, 64, 256]
    info = machine_info()
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = a.tokenizer or scratch
        if a.tokenizer is None:
            load_model_info(EngineArgs()).tokenizer.tok.save(os.path.join(scratch, "tokenizer.json"))
        args, llm = _engine(a.mode, tokenizer_dir, requests)
        vocab = llm.llm_engine.ready.vocab_size
        schemas = SCHEMAS[:3] if a.tiny else SCHEMAS
        results = {"mode": a.mode, "date": today(), "machine": info,
                   "compile": bench_compile(args, vocab, schemas),
                   "masks": bench_masks(args, vocab, counts, 3 if a.tiny else 32),
                   "throughput": bench_throughput(llm, _prompts(a.mode, llm, requests), max_tokens)}
        llm.llm_engine.shutdown()
    c, m, t = results["compile"], results["masks"]["median_ms_by_requests"], results["throughput"]
    print(f"{'measure':<44} {'value':>12}")
    print(f"{'compile, cold median (ms)':<44} {c['cold_median_ms']:>12}")
    print(f"{'compile, cached median (ms)':<44} {c['cached_median_ms']:>12}")
    for n, ms in m.items():
        print(f"{f'mask fill per step, {n} requests (ms)':<44} {ms:>12}")
    for name in ("unconstrained", "json_schema"):
        row = t[name]
        idle = f", GPU idle {row['gpu_idle_between_steps_s']} s" if "gpu_idle_between_steps_s" in row else ""
        label = f"{name} tok/s ({row['requests']} requests{idle})"
        print(f"{label:<44} {row['output_tok_per_s']:>12}")
    print(f"{'json_schema / unconstrained':<44} {t['ratio']:>12}")
    out = a.out or os.path.join(RESULTS_DIR, f"structured-{a.mode}{'-tiny' if a.tiny else ''}-{today()}.json")
    write_json(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
