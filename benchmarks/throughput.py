"""Offline throughput: a batch of random requests through `LLM.generate`, optionally side by side with HF transformers.

The workload is nano-vllm's bench.py, as the design doc specifies, so our numbers can be read next to
theirs: seed 0, draw every prompt (random token ids) first and every output length after, and
generate with ignore_eos so each request produces exactly its length. That draw order is what makes
256 requests come to 133,966 output tokens.

    python benchmarks/throughput.py                                  # the design doc's workload
    python benchmarks/throughput.py --device cpu --num-seqs 16 --min-input 64 --max-input 256 \\
        --min-output 32 --max-output 128 --concurrency 16 --hf      # a CPU-sized run against transformers

`--profile-steps N` adds, after the timed run, a kernel profile (benchmarks/step_profile.py) of N decode
steps with the batch full (`--concurrency` requests, all past their prefill), for explaining a
throughput miss by kernel (in-process engine).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from benchmarks.step_profile import print_profile, profile_steps
from ember import LLM, SamplingParams
from ember.bench.workloads import nano_vllm_requests
from ember.config import DEFAULT_MODEL, KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS
from ember.model.files import resolve_model

TEMPERATURE = 0.6
WARMUP_PROMPT_LEN, WARMUP_TOKENS = 32, 4
PROFILE_PROMPT_LEN = 128


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def head(self, n: int) -> Workload:
        return Workload(self.prompts[:n], self.max_tokens[:n])


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    return Workload(
        *nano_vllm_requests(args.num_seqs, args.min_input, args.max_input, args.min_output, args.max_output, vocab_size)
    )


def warmup_prompt(vocab_size: int) -> list[int]:
    """Ids from the top of the vocabulary, so the warm-up leaves nothing in the prefix cache a real prompt could hit."""
    return [vocab_size - 1 - i for i in range(WARMUP_PROMPT_LEN)]


class Timer:
    """Wall and process CPU seconds of a block; CPU per wall second falls below the thread count when other work
    shares the cores, which is how a result from a busy shared machine gives itself away."""

    def __enter__(self) -> Timer:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._wall
        self.cpu = time.process_time() - self._cpu


def result(workload: Workload, generated: int, timer: Timer, **extra: Any) -> dict[str, Any]:
    """Throughput counts the workload's tokens: what a static batch generates past a request's length is waste."""
    return {
        "requests": len(workload.prompts),
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": workload.output_tokens,
        "generated_tokens": generated,
        "elapsed_s": round(timer.wall, 3),
        "output_tok_per_s": round(workload.output_tokens / timer.wall, 2),
        "total_tok_per_s": round((workload.prompt_tokens + workload.output_tokens) / timer.wall, 2),
        "cpu_per_wall": round(timer.cpu / timer.wall, 2),
        **extra,
    }


# ---- Ember --------------------------------------------------------------------------------------


def _generate(llm: LLM, workload: Workload) -> int:
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=n) for n in workload.max_tokens]
    generated = sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False))
    if generated != workload.output_tokens:
        print(f"WARNING: Ember generated {generated} tokens, the workload asks for {workload.output_tokens}")
    return generated


def run_ember(args: argparse.Namespace, concurrency: int) -> tuple[dict[str, Any], dict[str, Any], Workload]:
    """Returns Ember's result, the engine settings it resolved (which the HF peer then copies), and the workload."""
    with Timer() as load:
        llm = LLM(
            model=args.model,
            load_format=args.load_format,
            dtype=args.dtype,
            device=args.device,
            max_model_len=args.max_model_len,
            max_num_seqs=concurrency,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory=args.kv_cache_memory,
            enforce_eager=args.enforce_eager,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            engine_process=args.engine_process,
            async_scheduling=args.async_scheduling,
            speculative_config=args.speculative_config,
        )
    engine = llm.llm_engine
    ready = engine.ready
    vocab = ready.vocab_size
    workload = make_workload(args, vocab)
    resolved = {
        "model_path": resolve_model(args.model),
        "dtype": ready.dtype,
        "device": ready.device,
        "vocab_size": vocab,
        "max_num_seqs": concurrency,
        "max_num_batched_tokens": ready.max_num_batched_tokens,
        "kv_cache_tokens": ready.kv_capacity_tokens,
        "quantization": ready.quantization,
        "kv_cache_dtype": ready.kv_cache_dtype,
        "weights_gib": round(ready.weight_bytes / 2**30, 3),
        "engine_process": bool(args.engine_process),
        "async_scheduling": ready.async_scheduling,
        "cuda_graphs": ready.cuda_graphs,
    }
    with Timer() as warmup:
        llm.generate(
            [{"prompt_token_ids": warmup_prompt(vocab)}],
            SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=WARMUP_TOKENS),
            use_tqdm=False,
        )

    print(
        f"{len(workload.prompts)} requests: {workload.prompt_tokens} prompt tokens, "
        f"{workload.output_tokens} output tokens"
    )
    before = engine.scheduler_stats()
    with Timer() as timer:
        generated = _generate(llm, workload)
    after = engine.scheduler_stats()  # the core's counters, read through its stats message
    gpu = {"steps": after.num_steps - before.num_steps}
    if ready.device.startswith("cuda"):
        gpu.update(
            gpu_idle_between_steps_s=round(after.gpu_idle_s - before.gpu_idle_s, 3),
            gpu_busy_in_steps_s=round(after.gpu_busy_s - before.gpu_busy_s, 3),
        )
    ember = result(workload, generated, timer, load_s=round(load.wall, 2), warmup_s=round(warmup.wall, 2), **gpu)
    print(f"ember: {ember['output_tok_per_s']:.1f} output tok/s {gpu}")
    if args.hf and args.hf_num_seqs and args.hf_num_seqs < len(workload.prompts):
        # The HF peer runs a subset: Ember runs the same one, so the ratio compares equal work.
        subset = workload.head(args.hf_num_seqs)
        with Timer() as sub_timer:
            sub_generated = _generate(llm, subset)
        ember["same_requests_as_hf"] = result(subset, sub_generated, sub_timer)
    if args.profile_steps:
        ember["profile"] = full_batch_profile(llm, concurrency, args.profile_steps)
        print_profile(ember["profile"], f"kernel profile at {concurrency} decoding requests")
    engine.shutdown()
    del llm
    gc.collect()  # the HF peer shares this process's memory
    return ember, resolved, workload


def full_batch_profile(llm: LLM, batch: int, steps: int, loras: list[Any] | None = None) -> dict[str, Any]:
    """Device time per step by kernel over `steps` decode steps of `batch` requests, profiled once every
    request is past its prefill (128-token prompts); the requests are then aborted. `loras`: request r's
    LoRARequest (or None), for benchmarks/lora.py."""
    engine = llm.llm_engine
    loras = loras or [None] * batch
    vocab = engine.ready.vocab_size
    ids = [
        engine.add_request(
            None,
            {"prompt_token_ids": [(7 * r + i) % vocab for i in range(PROFILE_PROMPT_LEN)]},
            SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=4 * steps + 64),
            lora_request=loras[r],
        )
        for r in range(batch)
    ]
    prefill_steps = -(-batch * PROFILE_PROMPT_LEN // engine.ready.max_num_batched_tokens)
    for _ in range(prefill_steps + 2):  # + 2: the last prefill's step and one in flight under async scheduling
        engine.step()
    result = profile_steps(engine.step, steps, torch.device(engine.ready.device))
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return result


# ---- HF transformers peer -------------------------------------------------------------------------


def load_hf_model(path: str, load_format: str, dtype: torch.dtype, device: str) -> Any:
    """The same weights Ember ran (or, for dummy, the same architecture with random weights), in the same dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, kwargs = path, {}
    if path.endswith(".gguf"):
        folder, kwargs = os.path.dirname(path), {"gguf_file": os.path.basename(path)}
    elif os.path.isfile(path):  # a config.json
        folder = os.path.dirname(path)
    if load_format == "dummy":
        config = AutoConfig.from_pretrained(folder, **kwargs)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa", **kwargs).to(
            device
        )
    return model.eval()


def sampling_config(**kwargs: Any) -> Any:
    """Ember's sampling: temperature only (top_k=0 and top_p=1 switch off HF's filters), never stopping at EOS."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0, **kwargs)


def run_hf_cb(model: Any, workload: Workload, resolved: dict[str, Any]) -> tuple[int, Timer]:
    """transformers' continuous batching, sized like Ember: requests per batch, tokens per step and KV capacity.

    `generate_batch` takes one `max_new_tokens` for every request, so we drive the manager it wraps
    directly: `add_request` takes each request's own length, and `eos_token_id=-1` turns off EOS,
    which makes this the exact workload Ember ran.
    """
    from transformers import ContinuousBatchingConfig

    cb_config = ContinuousBatchingConfig(
        max_requests_per_batch=resolved["max_num_seqs"], max_batch_tokens=resolved["max_num_batched_tokens"], seed=0
    )
    page = getattr(cb_config, "page_size", None) or getattr(cb_config, "block_size", None) or 256  # by version
    # Ember's capacity, or what the workload can ever hold if smaller (HF adds its own overheads on top).
    cb_config.num_blocks = math.ceil(
        min(resolved["kv_cache_tokens"], workload.prompt_tokens + workload.output_tokens + 4096) / page
    )
    gen_config = sampling_config(eos_token_id=-1, max_new_tokens=max(workload.max_tokens))
    with model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=cb_config, block=True
    ) as manager:
        _hf_cb_generate(manager, Workload([warmup_prompt(resolved["vocab_size"])], [WARMUP_TOKENS]), "warmup")
        with Timer() as timer:
            generated = _hf_cb_generate(manager, workload, "req")
    return generated, timer


def _hf_cb_generate(manager: Any, workload: Workload, tag: str) -> int:
    ids = [
        manager.add_request(p, request_id=f"{tag}{i}", max_new_tokens=n, eos_token_id=-1)
        for i, (p, n) in enumerate(zip(workload.prompts, workload.max_tokens))
    ]
    generated = 0
    pending = set(ids)
    while pending:
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped before finishing")
            continue
        if out.is_finished() and out.request_id in pending:
            if out.error is not None:
                raise RuntimeError(f"transformers request {out.request_id} failed: {out.error}")
            pending.discard(out.request_id)
            generated += len(out.generated_tokens)
    return generated


def run_hf_generate(model: Any, workload: Workload, batch_size: int, vocab_size: int) -> tuple[int, Timer]:
    """Static batches of `batch_size` in request order, left-padded; each batch runs to its longest request.

    `min_new_tokens` equal to `max_new_tokens` pins every row's length, as ignore_eos does in Ember.
    """

    def generate(prompts: list[list[int]], new_tokens: int) -> int:
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        config = sampling_config(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return (out.shape[1] - width) * len(prompts)

    generate([warmup_prompt(vocab_size)], WARMUP_TOKENS)
    generated = 0
    with Timer() as timer:
        for i in range(0, len(workload.prompts), batch_size):
            generated += generate(workload.prompts[i : i + batch_size], max(workload.max_tokens[i : i + batch_size]))
    return generated, timer


def run_hf(args: argparse.Namespace, workload: Workload, resolved: dict[str, Any]) -> dict[str, Any]:
    import transformers

    with Timer() as load:
        model = load_hf_model(
            resolved["model_path"], args.load_format, getattr(torch, resolved["dtype"]), resolved["device"]
        )
    mode = args.hf_mode
    if mode == "auto":  # continuous batching arrived in transformers 4.56
        mode = "cb" if hasattr(model, "continuous_batching_context_manager") else "generate"
    torch.manual_seed(0)
    cb_error = None
    if mode == "cb":
        try:
            generated, timer = run_hf_cb(model, workload, resolved)
        except Exception as e:  # noqa: BLE001 - transformers' CB API changes between releases: fall back to static batches
            cb_error, mode = f"{type(e).__name__}: {e}", "generate"
            print(f"transformers continuous batching failed ({cb_error}); running static batches instead")
            model.set_attn_implementation("sdpa")
    if mode == "generate":
        generated, timer = run_hf_generate(model, workload, resolved["max_num_seqs"], resolved["vocab_size"])
    return result(
        workload,
        generated,
        timer,
        mode=mode,
        transformers=transformers.__version__,
        load_s=round(load.wall, 2),
        cb_error=cb_error,
    )


# ---- reporting ------------------------------------------------------------------------------------


def model_short_name(model: str | None) -> str:
    if model is None or model.lower() == DEFAULT_MODEL:
        return DEFAULT_MODEL
    path = model.rstrip("/")
    if os.path.basename(path) == "config.json":
        path = os.path.dirname(path)
    return os.path.basename(path).removesuffix(".gguf").lower()


def print_table(results: dict[str, Any]) -> None:
    header = (
        f"{'':<14}{'requests':>9}{'prompt tok':>12}{'output tok':>12}{'elapsed s':>11}{'out tok/s':>11}"
        f"{'total tok/s':>13}"
    )
    print(header)
    for name in ("ember", "hf"):
        r = results[name]
        if r is not None:
            label = name if name == "ember" else f"hf ({r['mode']})"
            print(
                f"{label:<14}{r['requests']:>9}{r['prompt_tokens']:>12}{r['output_tokens']:>12}"
                f"{r['elapsed_s']:>11.2f}{r['output_tok_per_s']:>11.2f}{r['total_tok_per_s']:>13.2f}"
            )
    if results["ratio"] is not None:
        print(f"{'ember / hf':<14}{'':>44}{results['ratio']:>10.2f}x")


def write_chart(path: str, results: dict[str, Any], title: str) -> None:
    """Optional: matplotlib is no project dependency, so without it there is simply no chart."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {
        ("ember" if k == "ember" else f"hf ({v['mode']})"): v
        for k, v in results.items()
        if k in ("ember", "hf") and v is not None
    }
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(list(runs), [r["output_tok_per_s"] for r in runs.values()], color=["#d9541e", "#4a7ab5"][: len(runs)])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help=f"HF directory, config.json, .gguf file (default: {DEFAULT_MODEL})")
    p.add_argument(
        "--load-format", default="auto", choices=LOAD_FORMATS, help="'dummy': random weights from config.json alone"
    )
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input", type=int, default=100)
    p.add_argument("--max-input", type=int, default=1024)
    p.add_argument("--min-output", type=int, default=100)
    p.add_argument("--max-output", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=float, default=None, help="KV cache size in GiB (CPU)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the engine core in its own process (default: LLM's default)",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: the engine's (on with one CUDA GPU)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="cap on concurrently running requests (overrides --max-num-seqs; HF's batch size too)",
    )
    p.add_argument("--speculative-config", default=None, help="JSON, as `ember serve --speculative-config`")
    p.add_argument("--hf", action="store_true", help="also run HF transformers on the same requests")
    p.add_argument("--hf-num-seqs", type=int, default=None, help="run HF on the first N requests only (default: all)")
    p.add_argument(
        "--hf-mode",
        choices=("auto", "cb", "generate"),
        default="auto",
        help="cb: transformers' continuous batching; generate: static batches (auto: cb if available)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="profile this many decode steps of a full batch by kernel (in-process engine)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/throughput-<model>-<device>-"
        "<date>.json); a PNG chart goes next to it if matplotlib is installed",
    )
    args = p.parse_args(argv)
    if not 1 <= args.min_input <= args.max_input or not 1 <= args.min_output <= args.max_output:
        p.error("need 1 <= --min-input <= --max-input and 1 <= --min-output <= --max-output")
    if args.max_input + args.max_output > args.max_model_len:
        p.error("--max-input + --max-output must fit in --max-model-len")
    if args.num_seqs < 1 or (args.hf_num_seqs is not None and args.hf_num_seqs < 1):
        p.error("--num-seqs and --hf-num-seqs must be positive")
    if args.profile_steps and args.engine_process:
        p.error("--profile-steps profiles this process: leave out --engine-process")
    if args.profile_steps:
        args.engine_process = False
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    machine = machine_info()
    concurrency = args.concurrency or args.max_num_seqs
    ember, resolved, workload = run_ember(args, concurrency)
    hf = run_hf(args, workload.head(args.hf_num_seqs or args.num_seqs), resolved) if args.hf else None
    same = ember.get("same_requests_as_hf", ember)
    results = {
        "ember": ember,
        "hf": hf,
        "ratio": round(same["output_tok_per_s"] / hf["output_tok_per_s"], 3) if hf else None,
    }
    print_table(results)

    out = args.out or os.path.join(
        RESULTS_DIR, f"throughput-{model_short_name(args.model)}-{resolved['device'].split(':')[0]}-{today()}.json"
    )
    write_json(
        out,
        {
            "benchmark": "throughput",
            "date": today(),
            "machine": machine,
            "command": sys.argv,
            "config": {**vars(args), "resolved": resolved},
            "results": results,
        },
    )
    write_chart(
        os.path.splitext(out)[0] + ".png",
        results,
        f"{model_short_name(args.model)}, {resolved['device']}, {len(workload.prompts)} requests, "
        f"concurrency {concurrency}",
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
