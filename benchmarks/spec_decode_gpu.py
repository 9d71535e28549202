"""What speculative decoding costs and gains on a GPU: the time of a verify step with k = 1..8 draft
tokens per request against a plain decode step (batch 1 and 32), an EAGLE-3 head's cost per step, and
the time per token each acceptance rate then gives (the projected speed-up).

Steps are timed through the engine core in this process (`engine_process=False`): requests are
prefilled, then before each step every request is handed k draft tokens (random ids, so the random-
weight model rejects nearly all of them: a verify step's cost does not depend on what it accepts),
and the core's `step()` (schedule, forward, verification, bookkeeping, n-gram lookup) is timed. With
i.i.d. acceptance a, a step of k drafts emits (1 - a^(k+1)) / (1 - a) tokens on average, so the time
per token at acceptance a is t(k) * (1 - a) / (1 - a^(k+1)), minimised over k.

    python benchmarks/spec_decode_gpu.py --model benchmarks/configs/llama-3.1-8b \\
        --eagle benchmarks/configs/eagle3-llama-3.1-8b --acceptance 0.6
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

if not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from ember import LLM, SamplingParams
from ember.messages import EngineCoreRequest

PROMPT_LEN = 512


def _core(llm: LLM) -> Any:
    return llm.llm_engine.client.loop.core


def _engine(args: argparse.Namespace, spec: dict[str, Any]) -> LLM:
    return LLM(
        args.model,
        load_format="dummy",
        max_model_len=args.max_model_len,
        engine_process=False,
        speculative_config={**spec, "draft_token_budget": 4096},
    )


def _prefill(core: Any, batch: int, vocab: int) -> None:
    rng = random.Random(0)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=2048)
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(PROMPT_LEN)]
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, 2048, [], time.monotonic()))
    while any(not r.output_token_ids for r in core.requests.values()):
        core.step()


def _keep(core: Any, batch: int) -> None:
    """Abort all but `batch` running requests."""
    core.abort_requests(sorted(core.requests)[batch:])


def time_steps(core: Any, k: int | None, steps: int, vocab: int) -> float:
    """Median ms of a core step with k forced drafts per request (None: the drafter's own)."""
    rng = random.Random(k)
    times = []
    for _ in range(steps + 3):
        if k is not None:
            for req in core.requests.values():
                req.spec_token_ids = [rng.randrange(vocab) for _ in range(k)]
        start = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[3:])


def time_per_token(step_ms: dict[int, float], acceptance: float) -> tuple[float, int]:
    """The best (ms per emitted token, k) at i.i.d. acceptance `acceptance`."""
    best = (step_ms[0], 0)
    for k, ms in step_ms.items():
        emitted = (1 - acceptance ** (k + 1)) / (1 - acceptance) if acceptance < 1 else k + 1
        best = min(best, (ms / emitted, k))
    return best


def greedy_exactness(args: argparse.Namespace) -> dict[str, Any]:
    """The same greedy requests with and without n-gram speculation (and tok/s of each): how many outputs
    are identical token for token. In bf16 a verify step's batched matmuls round differently from a
    decode step's, so a near tie in a random model's flat distribution can flip."""
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(500) for _ in range(rng.randint(64, 512))]} for _ in range(64)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=128)
    outputs, rates = {}, {}
    for name, spec in (("off", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4})):
        llm = LLM(
            args.exact_model,
            load_format="dummy",
            max_model_len=args.max_model_len,
            speculative_config=spec,
            engine_process=True,  # its GPU memory goes with its process
        )
        llm.generate(prompts[:2], params, use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        rates[name] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
        outputs[name] = [o.outputs[0].token_ids for o in outs]
        llm.llm_engine.shutdown()
    same = sum(a == b for a, b in zip(outputs["off"], outputs["ngram"]))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(*outputs.values())]
    print(
        f"greedy exactness: {same}/{len(prompts)} identical; tok/s off {rates['off']:.0f}, ngram {rates['ngram']:.0f}"
    )
    return {"identical": same, "requests": len(prompts), "first_difference": first, "tok_per_s": rates}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    p.add_argument("--eagle", default=None, help="an EAGLE-3 head's directory (config.json; random weights)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8, 0.9])
    p.add_argument("--measured-acceptance", type=float, default=None, help="e.g. the CPU n-gram benchmark's")
    p.add_argument("--exact-model", default=None, help="also compare greedy outputs with and without speculation")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    info = machine_info()
    result: dict[str, Any] = {"date": today(), "machine": info, "command": " ".join(sys.argv), "batches": {}}
    if args.exact_model:  # first: its engines run in their own processes, and the memory is all theirs
        result["greedy_exactness"] = greedy_exactness(args)
    batches = sorted(args.batches, reverse=True)  # one engine per method: the largest batch first, then fewer
    llm = _engine(args, {"method": "ngram", "num_speculative_tokens": args.max_k})
    core = _core(llm)
    vocab = core.vocab_size
    _prefill(core, batches[0], vocab)
    for batch in batches:
        _keep(core, batch)
        step_ms = {k: time_steps(core, k, args.steps, vocab) for k in range(args.max_k + 1)}
        row: dict[str, Any] = {
            "step_ms": step_ms,
            "verify_over_decode": {k: ms / step_ms[0] for k, ms in step_ms.items()},
        }
        row["projected"] = {
            str(a): dict(zip(("ms_per_token", "k"), time_per_token(step_ms, a))) for a in args.acceptance
        }
        if args.measured_acceptance is not None:
            ms, k = time_per_token(step_ms, args.measured_acceptance)
            row["at_measured_acceptance"] = {"acceptance": args.measured_acceptance, "ms_per_token": ms, "k": k}
        result["batches"][str(batch)] = row
        print(
            f"batch {batch}: decode {step_ms[0]:.2f} ms; verify/decode "
            + ", ".join(f"k={k} {v:.3f}" for k, v in row["verify_over_decode"].items())
        )
        for a, proj in row["projected"].items():
            print(f"batch {batch}: acceptance {a}: {proj['ms_per_token']:.2f} ms/token at k={proj['k']}")
    del llm, core
    if args.eagle:
        k = min(4, args.max_k)
        eagle = _engine(args, {"method": "eagle3", "model": args.eagle, "num_speculative_tokens": k})
        core = _core(eagle)
        _prefill(core, batches[0], vocab)
        for batch in batches:
            _keep(core, batch)
            row = result["batches"][str(batch)]
            row["eagle3_k4_step_ms"] = time_steps(core, None, args.steps, vocab)
            row["eagle3_head_ms"] = row["eagle3_k4_step_ms"] - row["step_ms"][k]
            step, head = row["eagle3_k4_step_ms"], row["eagle3_head_ms"]
            print(f"batch {batch}: EAGLE-3 step (k={k}) {step:.2f} ms, head {head:.2f} ms")
    out = args.out or os.path.join(RESULTS_DIR, f"spec-decode-gpu-{today()}.json")
    write_json(out, result)
    plot(result, out.removesuffix(".json") + ".png")
    print(f"wrote {out}")


def plot(result: dict[str, Any], path: str) -> None:
    """Verify step / decode step per k, and projected ms per token per acceptance rate, per batch size."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for batch, row in result["batches"].items():
        ks = sorted(row["verify_over_decode"], key=int)
        left.plot([int(k) for k in ks], [row["verify_over_decode"][k] for k in ks], marker="o", label=f"batch {batch}")
        rates = sorted(row["projected"], key=float)
        decode = row["step_ms"][0] if 0 in row["step_ms"] else row["step_ms"]["0"]
        right.plot(
            [float(a) for a in rates],
            [row["projected"][a]["ms_per_token"] for a in rates],
            marker="o",
            label=f"batch {batch} (decode {decode:.2f} ms)",
        )
    left.set(xlabel="draft tokens per request (k)", ylabel="verify step / decode step", title="cost of verifying")
    right.set(xlabel="acceptance rate", ylabel="ms per output token (best k)", title="projected time per token")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
