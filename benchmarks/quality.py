"""Quality under quantization: perplexity on a fixed text, and greedy agreement with the unquantized model.

Quantized weights (int8, int4, fp8 block-scaled or per-channel `ptpc_fp8`, or a GGUF file's own
blocks) and an fp8 KV cache buy memory and speed with accuracy; throughput and latency measure what
they buy, this measures what they cost, on one fixed text so that modes, commits and machines
compare. Each mode loads the model anew, with `quantization` set to the mode ("none" is the float
model, and on a GGUF file means dequantized) and the same `kv_cache_dtype` for all modes, so the
baseline carries the KV cache setting too: compare a `--kv-cache-dtype fp8` run with an `auto` run
to see what the cache alone costs.

- Perplexity: the text, tokenized once, is cut into non-overlapping windows of `--window` tokens (the
  tokens the tokenizer puts before any text, e.g. a BOS, start every window; a last partial window is
  dropped, so every window has the same length). Each window runs as a prompt with `prompt_logprobs=0`;
  ppl = exp(-mean logprob of every token after a window's first).
- Greedy agreement: `--num-prompts` prompts of `--prompt-len` tokens, spread evenly over the text, each
  generate `--max-tokens` tokens greedily with `ignore_eos`; each mode is compared with "none", which
  always runs first. `exact_prefix_frac`: mean over prompts of (tokens equal before the first difference)
  / max_tokens; `token_agreement`: the fraction of all positions where the tokens are equal.

The text (benchmarks/data/quality.txt, about 3,800 words) is public domain: the King James Bible's
Genesis 1-2 (1611; public domain everywhere but the UK, where the Crown's letters patent still govern
printing it), the Declaration of Independence (1776, the National Archives transcription), Lincoln's
Gettysburg Address (1863, the Bliss copy) and his Second Inaugural Address (1865).

A model with no tokenizer (a config.json with `--load-format dummy`) is fed the default model's
tokenization, ids folded into its vocabulary: random weights give a meaningless perplexity, but the
same one for every run, so modes still compare.

    python benchmarks/quality.py --device cpu                                    # default model, every mode
    python benchmarks/quality.py --device cpu --modes none --max-windows 2 --num-prompts 2 --max-tokens 16
    python benchmarks/quality.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --modes none int8
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any

import torch

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from benchmarks.throughput import model_short_name
from ember import LLM, SamplingParams
from ember.config import KV_CACHE_DTYPES, LOAD_FORMATS, EngineArgs
from ember.model.files import load_model_info, resolve_model
from ember.model.loader import load_model_files
from ember.tokenizer import Tokenizer

MODES = ("none", "int8", "int4", "fp8", "ptpc_fp8", "gguf")
TEXT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "quality.txt")


def engine_kwargs(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """Mode "none" goes in as `quantization="none"`, never None: the engine reads None on a GGUF file as "keep
    its own quantization"."""
    return {
        "quantization": mode,
        "kv_cache_dtype": args.kv_cache_dtype,
        "load_format": args.load_format,
        "dtype": args.dtype,
        "device": args.device,
        "max_model_len": args.max_model_len,
        "kv_cache_memory": args.kv_cache_memory,
    }


def tokenize_text(args: argparse.Namespace, text: str) -> tuple[list[int], list[int], str]:
    """The text's ids, the ids the tokenizer puts before any text (a BOS, or nothing), and whose tokenizer
    it was, read from the model's files (no weights). Without a tokenizer of its own, the model gets the
    default model's tokens folded into its vocabulary."""
    config_only = EngineArgs(model=args.model, load_format="dummy").load_config()
    tokenizer: Tokenizer | None = load_model_info(config_only).tokenizer
    source = "model"
    if tokenizer is None:
        tokenizer, source = (
            load_model_info(EngineArgs(load_format="dummy").load_config()).tokenizer,
            "default model, folded",
        )
    vocab = load_model_files(config_only).model_config.vocab_size
    ids = [i % vocab for i in tokenizer.encode(text, add_special_tokens=False)]
    prefix = [i % vocab for i in tokenizer.encode("", add_special_tokens=True)]
    return ids, prefix, source


def make_windows(ids: list[int], prefix: list[int], window: int, max_windows: int | None) -> list[list[int]]:
    body = window - len(prefix)
    windows = [prefix + ids[i : i + body] for i in range(0, len(ids) - body + 1, body)]
    return windows[:max_windows]


def make_prompts(ids: list[int], prefix: list[int], num: int, length: int) -> list[list[int]]:
    """Evenly spaced over the text, so the prompts sample all of its sources rather than only the first."""
    step = (len(ids) - length) // max(num - 1, 1)
    return [prefix + ids[i * step : i * step + length] for i in range(num)]


def perplexity(llm: LLM, windows: list[list[int]]) -> dict[str, Any]:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    logprobs = [
        entry[token].logprob for out, w in zip(outputs, windows) for token, entry in zip(w[1:], out.prompt_logprobs[1:])
    ]
    nll = -math.fsum(logprobs) / len(logprobs)
    return {
        "ppl": round(math.exp(nll), 4),
        "nll": round(nll, 5),
        "predicted_tokens": len(logprobs),
        "ppl_elapsed_s": round(elapsed, 3),
        "ppl_tok_per_s": round(sum(map(len, windows)) / elapsed, 1),
    }


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def agreement(base: list[list[int]], other: list[list[int]], max_tokens: int) -> dict[str, Any]:
    prefixes = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(base, other)
    ]
    equal = sum(a == b for x, y in zip(base, other) for a, b in zip(x, y))
    return {
        "exact_prefix_frac": round(statistics.fmean(p / max_tokens for p in prefixes), 4),
        "token_agreement": round(equal / (len(base) * max_tokens), 4),
        "agreeing_prefix": prefixes,
    }


def run_mode(
    args: argparse.Namespace,
    mode: str,
    windows: list[list[int]],
    prompts: list[list[int]],
    baseline: list[list[int]] | None,
) -> tuple[dict[str, Any], list[list[int]]]:
    """Load the model in `mode`, generate, measure; returns the result and the greedy tokens (the baseline's
    when `baseline` is None). The LLM is local, so it is gone once this returns."""
    kwargs = engine_kwargs(args, mode)
    print(f"--- {mode}: LLM({args.model!r}, {', '.join(f'{k}={v!r}' for k, v in kwargs.items())})", flush=True)
    start = time.perf_counter()
    llm = LLM(model=args.model, **kwargs)
    load_s = time.perf_counter() - start
    ready = llm.llm_engine.ready
    generated = greedy(llm, prompts, args.max_tokens)  # also the warm-up before the timed perplexity pass
    result = {
        **perplexity(llm, windows),
        **agreement(baseline or generated, generated, args.max_tokens),
        "weight_bytes": ready.weight_bytes,
        "dtype": ready.dtype,
        "device": ready.device,
        "load_s": round(load_s, 2),
        "engine_kwargs": kwargs,
    }
    llm.llm_engine.shutdown()
    return result, generated


def free_memory() -> None:
    """The last mode's weights and KV cache must be gone before the next mode loads, or memory holds two models
    at once (an engine's reference cycles wait for the collector)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print(
        f"{'mode':<6}{'ppl':>10}{'d ppl %':>9}{'prefix':>8}{'agree':>7}{'weights MiB':>13}{'load s':>8}"
        f"{'ppl tok/s':>11}"
    )
    for mode, r in results.items():
        if "error" in r:
            print(f"{mode:<6}{r['error']}")
            continue
        print(
            f"{mode:<6}{r['ppl']:>10.4f}{r['ppl_delta_pct']:>9.2f}{r['exact_prefix_frac']:>8.3f}"
            f"{r['token_agreement']:>7.3f}{r['weight_bytes'] / 2**20:>13.1f}{r['load_s']:>8.2f}"
            f"{r['ppl_tok_per_s']:>11.1f}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF directory, config.json or .gguf file (default: the default model)")
    p.add_argument(
        "--load-format", default="auto", choices=LOAD_FORMATS, help="'dummy': random weights from config.json alone"
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="'none' is the unquantized float model and always runs first, as the baseline",
    )
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="for every mode, none included")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=float, default=None, help="KV cache size in GiB (CPU)")
    p.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    p.add_argument("--max-windows", type=int, default=None, help="use only the first N windows (quick runs)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64, help="text tokens per greedy prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/quality-<model>-<device>-"
        "<date>.json, '-kv-fp8' before .json with --kv-cache-dtype fp8)",
    )
    args = p.parse_args(argv)
    for name in ("window", "num_prompts", "prompt_len", "max_tokens", "max_model_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.max_windows is not None and args.max_windows < 1:
        p.error("--max-windows must be positive")
    if args.window < 2 or args.window > args.max_model_len:
        p.error("--window must be in [2, --max-model-len]")
    if args.prompt_len + args.max_tokens + 1 > args.max_model_len:  # + 1: room for a BOS
        p.error("--prompt-len + --max-tokens must fit in --max-model-len")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    machine = machine_info()
    with open(TEXT_PATH, encoding="utf-8") as f:
        text = f.read()
    ids, prefix, tokenizer_source = tokenize_text(args, text)
    windows = make_windows(ids, prefix, args.window, args.max_windows)
    if not windows:
        sys.exit(f"the text has {len(ids)} tokens, fewer than one --window of {args.window}")
    prompts = make_prompts(ids, prefix, args.num_prompts, args.prompt_len)
    modes = ["none"] + [m for m in dict.fromkeys(args.modes) if m != "none"]
    resolved = {
        "model_path": resolve_model(args.model),
        "tokenizer": tokenizer_source,
        "text_tokens": len(ids),
        "prefix_tokens": prefix,
        "windows": len(windows),
        "modes_run": modes,
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }

    results: dict[str, dict[str, Any]] = {}
    results["none"], baseline = run_mode(args, "none", windows, prompts, None)
    free_memory()
    for mode in modes[1:]:
        try:  # one mode the engine refuses (e.g. gguf on a safetensors model) must not cost the others' results
            results[mode] = run_mode(args, mode, windows, prompts, baseline)[0]
        except Exception as e:  # noqa: BLE001 - one mode the engine refuses must not cost the others' results
            results[mode] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        free_memory()
    for r in results.values():
        if "ppl" in r:
            r["ppl_delta_pct"] = round((r["ppl"] / results["none"]["ppl"] - 1) * 100, 3)
    print_table(results)

    suffix = "" if args.kv_cache_dtype == "auto" else f"-kv-{args.kv_cache_dtype}"
    out = args.out or os.path.join(
        RESULTS_DIR,
        f"quality-{model_short_name(args.model)}-{results['none']['device'].split(':')[0]}-{today()}{suffix}.json",
    )
    write_json(
        out,
        {
            "benchmark": "quality",
            "date": today(),
            "machine": machine,
            "command": sys.argv,
            "config": {**vars(args), "resolved": resolved},
            "results": results,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
