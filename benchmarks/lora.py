"""Multi-LoRA: output tok/s of requests spread round-robin over A random adapters against the same requests on the
base model, batch-1 time per token with one adapter against none, and an adapter's runtime load to first use
(issue 31's targets).

Phases, in the library, each after a two-request warm-up: `base` (an engine without LoRA), `base-lora-on` (the base
alone on an engine with `--enable-lora`: what turning LoRA on costs requests that use none) and `adapters` (the
requests dealt round-robin to the adapters); `--rounds R` alternates the phases R times and keeps each one's median:
on the CPU all three (both engines stay in the process), on a GPU the last two on the one engine, the base engine
having run once before it. The ratio of the adapters to the base-only rounds of the same engine
(`adapters_vs_lora_on`) is the one outside load moves least. The adapters are random PEFT
directories written for the model's shapes (every target: q/k/v/o, gate/up/down; rank `--rank`, float32 tensors, held
in the slots in `--lora-dtype`; `max_loras` = `--adapters`). Workloads: `stories` ("Write a story about the number
i.", greedy, `--max-tokens` each, the CPU default) and `nano-vllm` (the design doc's 256 random-token requests at
temperature 0.6, benchmarks/throughput.py's workload). `--latency` adds batch-1 TPOT (512-token prompt, 128 tokens;
benchmarks/latency.py's measure) on the base engine, and on the LoRA engine without an adapter and with one; `--load`
the seconds from a request naming a new adapter (never loaded, on disk) to its first token, beside the same request
under an adapter already resident.

    python benchmarks/lora.py                          # CPU: 16 requests over 4 rank-16 adapters, default model
    python benchmarks/lora.py --model benchmarks/configs/llama-3.1-8b --load-format dummy --workload nano-vllm \\
        --adapters 8 --latency --load                  # the GPU targets
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

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from safetensors.torch import save_file

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from benchmarks.latency import measure
from benchmarks.step_profile import print_profile
from benchmarks.throughput import full_batch_profile
from ember import LLM, LoRARequest, SamplingParams
from ember.bench.workloads import nano_vllm_requests
from ember.config import LOAD_FORMATS
from ember.lora.peft import TARGETS, LoRAShapes

Requests = tuple[list[Any], list[SamplingParams]]


def write_adapter(path: str, shapes: LoRAShapes, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter of every decoder-layer projection the engine adapts (not the embedding nor
    the LM head), for its model's shapes."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    projections = {module: shape for module, shape in shapes.shapes.items() if module in TARGETS}
    for layer in range(shapes.num_layers):
        for module, (n_in, n_out) in projections.items():
            prefix = f"base_model.model.model.layers.{layer}.{TARGETS[module][0].split('.')[0]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(projections)}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def make_requests(args: argparse.Namespace, vocab_size: int) -> Requests:
    if args.workload == "nano-vllm":
        prompts, lengths = nano_vllm_requests(args.requests, vocab_size=vocab_size)
        params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in lengths]
        return [{"prompt_token_ids": p} for p in prompts], params
    prompts = [f"Write a story about the number {i}." for i in range(args.requests)]
    return prompts, [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)] * len(prompts)


def timed(llm: LLM, requests: Requests, loras: list[LoRARequest | None]) -> float:
    """Output tok/s of one generate call over every request, after a two-request warm-up."""
    prompts, params = requests
    llm.generate(prompts[:2], params[:2], use_tqdm=False, lora_request=loras[:2])
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def tpot_ms(llm: LLM, lora: LoRARequest | None) -> float:
    """Median batch-1 time per output token: a 512-token prompt, 128 tokens, three runs after a warm-up."""
    rng = random.Random(0)
    vocab = llm.llm_engine.ready.vocab_size
    measure(llm, [rng.randrange(vocab) for _ in range(16)], 8, lora)
    runs = [statistics.median(measure(llm, [rng.randrange(vocab) for _ in range(512)], 128, lora)[1]) for _ in range(3)]
    return round(statistics.median(runs) * 1e3, 3)


def first_token_s(llm: LLM, lora: LoRARequest) -> float:
    """Seconds from submitting a 16-token, 1-token request under `lora` to its output."""
    start = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": list(range(1, 17))}], SamplingParams(max_tokens=1), use_tqdm=False, lora_request=lora
    )
    return time.perf_counter() - start


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory, config.json or .gguf (default: the default model)")
    parser.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workload", choices=("stories", "nano-vllm"), default="stories")
    parser.add_argument("--requests", type=int, default=None, help="default: 16 stories, 256 nano-vllm")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--lora-dtype", default="auto", help="the slots' dtype (auto: the model's; bfloat16 halves a CPU step's reads)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="stories' output length")
    parser.add_argument(
        "--rounds", type=int, default=1, help="LoRA-engine phases alternated this many times (medians kept)"
    )
    parser.add_argument("--latency", action="store_true", help="batch-1 TPOT with one adapter vs the base")
    parser.add_argument("--load", action="store_true", help="a new adapter's load to first token")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="kernel profile of this many decode steps of the full batch, base-lora-on and adapters (in process)",
    )
    parser.add_argument("--output", default=None, help="default: benchmarks/results/lora-<device>-<date>.json")
    args = parser.parse_args()
    if args.profile_steps and args.engine_process:
        parser.error("--profile-steps profiles this process: leave out --engine-process")
    args.requests = args.requests or (256 if args.workload == "nano-vllm" else 16)
    args.output = args.output or os.path.join(RESULTS_DIR, f"lora-{args.device.split(':')[0]}-{today()}.json")
    return args


def main() -> None:
    args = parse_args()
    machine = machine_info()
    engine: dict[str, Any] = dict(
        model=args.model,
        load_format=args.load_format,
        device=args.device,
        engine_process=args.engine_process,
        max_model_len=4096,
    )
    tok_s: dict[str, float] = {}
    latency: dict[str, float] = {}
    base = LLM(**engine)
    requests = make_requests(args, base.llm_engine.ready.vocab_size)
    none = [None] * len(requests[0])
    rounds: dict[str, list[float]] = {"base": [], "base-lora-on": [], "adapters": []}
    # On the CPU the base engine stays and takes part in every round: its one phase moved 539-687 tok/s between
    # runs (2026-12-07), too much for a ratio against it. A GPU holds one engine at a time (each sizes its KV
    # cache to the free memory), so there the base runs once, first.
    alongside = args.device == "cpu"
    if not alongside:
        rounds["base"].append(timed(base, requests, none))
    if args.latency:
        latency["base_tpot_ms"] = tpot_ms(base, None)
    if not alongside:
        base.llm_engine.shutdown()
        del base
    lora = LLM(**engine, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, lora_dtype=args.lora_dtype)
    with tempfile.TemporaryDirectory() as tmp:
        shapes = lora.llm_engine.ready.lora
        assert shapes is not None  # an engine with enable_lora sends them
        adapters = []
        for i in range(args.adapters + args.load):
            write_adapter(os.path.join(tmp, f"a{i}"), shapes, args.rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, os.path.join(tmp, f"a{i}")))
        dealt = [adapters[i % args.adapters] for i in range(len(none))]
        phases = [("base-lora-on", lora, none), ("adapters", lora, dealt)]
        if alongside:
            phases.insert(0, ("base", base, none))
        for i in range(args.rounds):
            # alternated, so that load from outside the run hits every phase alike, and in reversed order every
            # other round: the first phase of a round measured 2-10% above the second in every round (2026-12-07)
            for name, llm, loras in phases if i % 2 == 0 else phases[::-1]:
                rounds[name].append(timed(llm, requests, loras))
        tok_s.update({name: statistics.median(runs) for name, runs in rounds.items()})
        profiles = {}
        if args.profile_steps:
            batch = len(none)
            for name, loras in (("base-lora-on", none), ("adapters", dealt)):
                profiles[name] = full_batch_profile(lora, batch, args.profile_steps, loras)
                print_profile(profiles[name], f"{name}: kernel profile at {batch} decoding requests")
        if args.latency:
            latency["lora_on_base_tpot_ms"] = tpot_ms(lora, None)
            latency["adapter_tpot_ms"] = tpot_ms(lora, adapters[0])
            latency["ratio"] = round(latency["adapter_tpot_ms"] / latency["base_tpot_ms"], 3)
        if args.load:
            latency["resident_first_token_s"] = round(first_token_s(lora, adapters[0]), 3)
            latency["new_adapter_first_token_s"] = round(first_token_s(lora, adapters[-1]), 3)
    for name, value in tok_s.items():
        print(f"{name:>14}: {value:9.1f} output tok/s ({value / tok_s['base']:.3f}x the base)")
    print(
        f"{'adapters / lora-on':>18}: {tok_s['adapters'] / tok_s['base-lora-on']:.3f} (medians of {args.rounds} rounds)"
    )
    for name, value in latency.items():
        print(f"{name:>26}: {value}")
    write_json(
        args.output,
        {
            "benchmark": "lora",
            "date": today(),
            "command": " ".join(sys.argv),
            "machine": machine,
            "settings": vars(args),
            "output_tok_per_s": tok_s,
            "ratio_to_base": {k: round(v / tok_s["base"], 3) for k, v in tok_s.items()},
            "rounds_tok_per_s": rounds,
            "adapters_vs_lora_on": round(tok_s["adapters"] / tok_s["base-lora-on"], 3),
            "batch1_and_load": latency,
            "profiles": profiles,
        },
    )


if __name__ == "__main__":
    main()
