"""Batch-1 latency: time to first token (TTFT) and time per output token (TPOT).

The design doc's setting: Llama-3.1-8B architecture with random bf16 weights, a 512-token prompt,
256 output tokens; the roofline is weight bytes / memory bandwidth (about 3.7 ms per token on an H200).
`--profile-steps N` adds a kernel profile of N decode steps (torch.profiler, in-process engine): GPU time
per step by kernel, beside the step's roofline, for explaining a miss.

    python benchmarks/latency.py --model benchmarks/configs/llama-3.1-8b --load-format dummy
    python benchmarks/latency.py --device cpu --input-len 128 --output-len 32     # the default model on CPU
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

if not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from benchmarks.step_profile import print_profile, profile_steps
from ember import LLM, LoRARequest, SamplingParams
from ember.config import KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    llm: LLM, prompt: list[int], output_len: int, lora_request: LoRARequest | None = None
) -> tuple[float, list[float]]:
    """One request through engine.step(): seconds to the first token, then seconds per later step."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add_request(None, {"prompt_token_ids": prompt}, params, lora_request=lora_request)
    _sync(torch.device(engine.ready.device))
    start = time.perf_counter()
    ttft, steps, last = None, [], start
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        if outs and outs[0].outputs[0].token_ids:
            if ttft is None:
                ttft = now - start
            else:
                steps.append(now - last)
        last = now
    return ttft, steps


def kernel_profile(llm: LLM, prompt: list[int], steps: int, weight_bytes: int) -> dict:
    """Device time per decode step by kernel over `steps` steps of one request (the prefill step runs
    before the profile starts), beside the step's roofline at the H200's 4.3 TB/s."""
    engine = llm.llm_engine
    device = torch.device(engine.ready.device)
    engine.add_request(
        None, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    )
    engine.step()
    result = profile_steps(engine.step, steps, device)
    if device.type == "cuda":
        result["roofline_us_per_step"] = round(weight_bytes / 4.3e6, 1)  # every weight read once: MoE reads fewer
    while engine.has_unfinished_requests():
        engine.step()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-memory", type=float, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument(
        "--profile-steps", type=int, default=0, help="profile this many decode steps by kernel (in-process)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.profile_steps and args.engine_process:
        ap.error("--profile-steps profiles this process: leave out --engine-process")
    if args.profile_steps:
        args.engine_process = False

    machine = machine_info()
    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=8,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=False,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        engine_process=args.engine_process,
        async_scheduling=args.async_scheduling,
    )
    ready = llm.llm_engine.ready
    rng = random.Random(0)
    vocab = ready.vocab_size
    measure(llm, [rng.randrange(vocab) for _ in range(16)], 8)  # warm-up: kernels compiled, caches touched
    ttfts, tpots = [], []
    for _ in range(args.num_iters):
        ttft, steps = measure(llm, [rng.randrange(vocab) for _ in range(args.input_len)], args.output_len)
        ttfts.append(ttft)
        tpots.append(statistics.median(steps))
    weight_gib = ready.weight_bytes / 2**30
    results = {
        "ttft_ms": round(statistics.median(ttfts) * 1e3, 3),
        "tpot_ms": round(statistics.median(tpots) * 1e3, 3),
        "tpot_ms_all_iters": [round(t * 1e3, 3) for t in tpots],
        "weights_gib": round(weight_gib, 3),
        "dtype": ready.dtype,
        "quantization": ready.quantization,
        "kv_cache_dtype": ready.kv_cache_dtype,
        "device": ready.device,
        "cuda_graphs": ready.cuda_graphs,
        "async_scheduling": ready.async_scheduling,
        "engine_process": args.engine_process is not False,  # LLM's default (None) runs the core in its own process
    }
    print(f"{'input':>6} {'output':>6} {'TTFT ms':>9} {'TPOT ms':>9} {'weights GiB':>12}")
    print(
        f"{args.input_len:>6} {args.output_len:>6} {results['ttft_ms']:>9.2f} {results['tpot_ms']:>9.3f} "
        f"{weight_gib:>12.2f}"
    )
    name = os.path.basename(os.path.normpath(args.model)) if args.model else "smollm2-135m-instruct"
    out = args.out or os.path.join(RESULTS_DIR, f"latency-{name}-{ready.device.split(':')[0]}-{today()}.json")
    record = {
        "benchmark": "latency",
        "date": today(),
        "machine": machine,
        "command": sys.argv,
        "config": vars(args),
        "results": results,
    }
    write_json(out, record)
    if args.profile_steps:  # after the timings are written: a profiler failure keeps them
        results["profile"] = kernel_profile(
            llm, [rng.randrange(vocab) for _ in range(args.input_len)], args.profile_steps, ready.weight_bytes
        )
        print_profile(results["profile"])
        write_json(out, record)
    print("wrote", out)


if __name__ == "__main__":
    main()
