"""LoRA on CPU: output tok/s of N concurrent greedy requests spread round-robin over A random adapters, against
the same requests on the base model (issue 31's "CPU default model, 16 concurrent over 4 adapters vs base").

In the library, core in this process (`LLM(engine_process=False)`), the default model unless `--model`:
three phases, each after a two-request warm-up: `base` (an engine without LoRA), `base-lora-on` (the base
model alone on an engine with `--enable-lora`: what turning LoRA on costs requests that use none) and
`adapters` (the requests dealt round-robin to the adapters). The adapters are random PEFT directories
written for the model's shapes (every target: q/k/v/o, gate/up/down; rank `--rank`, float32 tensors;
`max_loras` = `--adapters`). Prompts are "Write a story about the number i." with `ignore_eos` and
`--max-tokens` each. The JSON (benchmarks/results/lora-cpu-<date>.json) keeps each phase's tok/s, the
ratios and the machine (its load average shows what else ran).

    python benchmarks/lora_cpu.py                         # 16 requests over 4 rank-16 adapters
    python benchmarks/lora_cpu.py --adapters 1 --rank 8 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from safetensors.torch import save_file

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from ember import LLM, LoRARequest, SamplingParams
from ember.lora.peft import TARGETS, LoRAShapes


def write_adapter(path: str, shapes: LoRAShapes, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter of every module the engine adapts, for its model's shapes."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for module, (n_in, n_out) in shapes.shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{TARGETS[module][0].split('.')[0]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shapes.shapes)}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def timed(llm: LLM, prompts: list[str], params: SamplingParams, loras: list[LoRARequest | None]) -> float:
    """Output tok/s of one generate call over every prompt, after a two-request warm-up."""
    llm.generate(prompts[:2], params, use_tqdm=False, lora_request=loras[:2])
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the default model)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", default=os.path.join(RESULTS_DIR, f"lora-cpu-{today()}.json"))
    args = parser.parse_args()
    machine = machine_info()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [f"Write a story about the number {i}." for i in range(args.requests)]
    engine: dict[str, Any] = dict(model=args.model, device="cpu", engine_process=False)
    results: dict[str, float] = {}
    base = LLM(**engine)
    results["base"] = timed(base, prompts, params, [None] * len(prompts))
    del base
    lora = LLM(**engine, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    results["base-lora-on"] = timed(lora, prompts, params, [None] * len(prompts))
    with tempfile.TemporaryDirectory() as tmp:
        shapes = lora.llm_engine.ready.lora
        assert shapes is not None  # an engine with enable_lora sends them
        adapters = []
        for i in range(args.adapters):
            write_adapter(os.path.join(tmp, f"a{i}"), shapes, args.rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, os.path.join(tmp, f"a{i}")))
        results["adapters"] = timed(lora, prompts, params, [adapters[i % len(adapters)] for i in range(len(prompts))])
    for name, value in results.items():
        print(f"{name:>14}: {value:7.1f} output tok/s ({value / results['base']:.2f}x the base)")
    write_json(
        args.output,
        {
            "benchmark": "lora-cpu",
            "command": " ".join(sys.argv),
            "machine": machine,
            "settings": vars(args),
            "output_tok_per_s": results,
            "ratio_to_base": {k: v / results["base"] for k, v in results.items()},
        },
    )


if __name__ == "__main__":
    main()
