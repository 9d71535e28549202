"""The fused MoE kernel alone on the GPU: time, achieved GB/s and TFLOP/s per batch size.

For the Qwen3-30B-A3B layer shape (E=128, k=8, H=2048, I=768) and the Mixtral-8x7B one (E=8, k=2,
H=4096, I=14336), random weights (bf16, or quantized with --kinds), tokens routed by `moe_route`
on random logits. Each batch size is timed inside a CUDA graph (which also proves the kernels never
sync with the host). Bytes are those of the experts the batch actually routes to plus the hidden
states in and out; FLOPs are 6 * M * k * H * I (gate, up and down). Both are set against the H200's
4.3 TB/s and 790 TFLOP/s (../shared/DESIGN.md); `roofline_us` is the larger of the two bounds.

    python benchmarks/moe_kernel.py --out benchmarks/results/moe-kernel-h200-<date>.json

--fused compares, per MoE layer (routing and alignment included, as the engine runs it), the
two-GEMM path with the one-kernel MLP (fused_moe.fused_mlp) at M = 1..4: its default tiles, or each
--fused-tiles set (BLOCK_I BLOCK_K BLOCK_H warps stages), with each one's error against the float64 reference:

    python benchmarks/moe_kernel.py --fused --out benchmarks/results/moe-fused-h100-<date>.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, cuda_graph_us, machine_info, today, write_json
from ember.kernels.fused_moe import (
    Experts,
    fused_moe,
    fused_moe_from_logits,
    fused_moe_ref,
    moe_config_for,
    weight_kind,
)
from ember.kernels.moe_config import FusedTiles, MoeConfig, default_fused_tiles, device_key, lookup, problem_key
from ember.kernels.moe_routing import moe_route
from ember.quant.experts import QuantizedExperts, quantize_experts

PEAK_GBS = 4300.0
PEAK_TFLOPS = 790.0
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
FUSED_BATCH_SIZES = [1, 2, 3, 4]


class MoeShape(NamedTuple):
    num_experts: int
    top_k: int
    hidden: int
    inter: int


# The routed experts of each layer; DeepSeek-V2-Lite's two shared experts run as a dense MLP beside them.
SHAPES = {
    "qwen3-30b-a3b": MoeShape(128, 8, 2048, 768),
    "mixtral-8x7b": MoeShape(8, 2, 4096, 14336),
    "deepseek-v2-lite": MoeShape(64, 6, 2048, 1408),
}
KINDS = ("bf16", "int8", "int4", "fp8")


def make_experts(shape: MoeShape, kind: str, gen: torch.Generator) -> tuple[Experts, Experts]:
    """Random w13 [E, 2I, H] and w2 [E, H, I] on the GPU: bf16, or quantized as `--quantization` does."""
    dev = torch.device("cuda")
    e, _, h, i = shape
    w13 = torch.randn(e, 2 * i, h, device=dev, generator=gen, dtype=torch.bfloat16) * h**-0.5
    w2 = torch.randn(e, h, i, device=dev, generator=gen, dtype=torch.bfloat16) * i**-0.5
    if kind == "bf16":
        return w13, w2
    return quantize_experts(w13, kind), quantize_experts(w2, kind)


def make_batch(shape: MoeShape, m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden bf16 [M, H], topk_weights, topk_ids) routed by the kernel on random router logits."""
    logits = torch.randn(m, shape.num_experts, device="cuda", generator=gen)
    weights, ids = moe_route(logits, shape.top_k, True)
    return torch.randn(m, shape.hidden, device="cuda", generator=gen, dtype=torch.bfloat16), weights, ids


def nbytes(w: Experts) -> int:
    return w.nbytes() if isinstance(w, QuantizedExperts) else w.numel() * w.element_size()


def touched_bytes(w13: Experts, w2: Experts, ids: torch.Tensor, hidden: torch.Tensor) -> int:
    """Weights of the distinct experts the batch routes to, plus hidden states in and out."""
    per_expert = (nbytes(w13) + nbytes(w2)) // (w13.num_experts if isinstance(w13, QuantizedExperts) else w13.shape[0])
    return per_expert * int(torch.unique(ids).numel()) + 2 * hidden.numel() * hidden.element_size()


def bench_us(fn, rep_ms: int) -> float:
    """Median time of fn replayed in a CUDA graph, in microseconds."""
    fn()  # compiles outside the capture
    return cuda_graph_us(fn, rep_ms)


def check_accuracy(shape: MoeShape, w13: Experts, w2: Experts, gen: torch.Generator) -> float:
    """Largest |fused - float32 reference| over a 5-token batch, relative to the reference's largest value."""
    hidden, weights, ids = make_batch(shape, 5, gen)
    ref = fused_moe_ref(hidden, w13, w2, weights, ids).float()
    out = fused_moe(hidden, w13, w2, weights, ids).float()
    return float((out - ref).abs().max() / ref.abs().max())


def measure(shape: MoeShape, w13: Experts, w2: Experts, m: int, rep_ms: int, gen: torch.Generator) -> dict[str, Any]:
    hidden, weights, ids = make_batch(shape, m, gen)
    logits = torch.randn(m, shape.num_experts, device="cuda", generator=gen)
    us = bench_us(lambda: fused_moe(hidden, w13, w2, weights, ids), rep_ms)
    route_us = bench_us(lambda: moe_route(logits, shape.top_k, True), rep_ms)
    moved = touched_bytes(w13, w2, ids, hidden)
    flops = 6 * m * shape.top_k * shape.hidden * shape.inter
    key = problem_key(shape.num_experts, shape.hidden, shape.inter, weight_kind(w13))
    return {
        "m": m,
        "us": round(us, 2),
        "route_us": round(route_us, 2),
        "experts_touched": int(torch.unique(ids).numel()),
        "bytes": moved,
        "flops": flops,
        "gbs": round(moved / us / 1e3, 1),
        "tflops": round(flops / us / 1e6, 2),
        "bandwidth_fraction": round(moved / us / 1e3 / PEAK_GBS, 3),
        "compute_fraction": round(flops / us / 1e6 / PEAK_TFLOPS, 4),
        "roofline_us": round(max(moved / PEAK_GBS / 1e3, flops / PEAK_TFLOPS / 1e6), 2),
        "config": moe_config_for(hidden, w13, w2, shape.top_k).to_json(),
        "tuned": lookup(device_key(hidden.device), key, m) is not None,
    }


def compare_fused(
    shape: MoeShape, w13: Experts, w2: Experts, m: int, tile_sets: list[FusedTiles], rep_ms: int, gen: torch.Generator
) -> dict[str, Any]:
    """One MoE layer (fused_moe_from_logits) at M tokens: the two-GEMM path's time, then each fused
    tile set's time, speed-up over it and largest error against the float64 reference."""
    hidden = torch.randn(m, shape.hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    logits = torch.randn(m, shape.num_experts, device="cuda", generator=gen)
    weights, ids = moe_route(logits, shape.top_k, True)
    ref = fused_moe_ref(hidden, w13, w2, weights, ids).double()

    def layer(cfg: MoeConfig) -> torch.Tensor:
        return fused_moe_from_logits(hidden, w13, w2, logits, shape.top_k, True, cfg)

    def rel_error(cfg: MoeConfig) -> float:
        return round(float((layer(cfg).double() - ref).abs().max() / ref.abs().max()), 5)

    def timed(cfg: MoeConfig) -> float:
        return bench_us(lambda: layer(cfg), rep_ms)

    two_kernel = moe_config_for(hidden, w13, w2, shape.top_k)._replace(fused=None)
    two_us = timed(two_kernel)
    row: dict[str, Any] = {
        "m": m,
        "two_kernel_us": round(two_us, 2),
        "two_kernel_config": two_kernel.to_json(),
        "two_kernel_rel_error": rel_error(two_kernel),
        "fused": [],
    }
    for tiles in tile_sets:
        cfg = two_kernel._replace(fused=tiles)
        us = timed(cfg)
        row["fused"].append(
            {"tiles": list(tiles), "us": round(us, 2), "speedup": round(two_us / us, 3), "rel_error": rel_error(cfg)}
        )
    return row


def run_fused(args: argparse.Namespace) -> list[dict[str, Any]]:
    """--fused: per shape, bf16 experts, the two paths side by side at each batch size."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for name in args.shapes:
        shape = SHAPES[name]
        w13, w2 = make_experts(shape, "bf16", gen)
        tile_sets = [FusedTiles(*t) for t in args.fused_tiles] or [default_fused_tiles(shape.top_k, shape.inter)]
        entry: dict[str, Any] = {"shape": name, **shape._asdict(), "kind": "bf16", "rows": []}
        for m in args.batch_sizes or FUSED_BATCH_SIZES:
            row = compare_fused(shape, w13, w2, m, tile_sets, args.rep_ms, gen)
            entry["rows"].append(row)
            best = min(row["fused"], key=lambda f: f["us"])
            print(f"{name} M={m}: two kernels {row['two_kernel_us']:.1f} us, fused {best['us']:.1f} us {best['tiles']}")
        results.append(entry)
        del w13, w2
        torch.cuda.empty_cache()
    return results


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    deadline = time.monotonic() + args.time_limit
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for name in args.shapes:
        shape = SHAPES[name]
        for kind in args.kinds:
            if time.monotonic() > deadline:
                print(f"time limit reached: skipping {name} {kind}")
                continue
            w13, w2 = make_experts(shape, kind, gen)
            entry = {
                "shape": name,
                **shape._asdict(),
                "kind": kind,
                "weight_bytes": nbytes(w13) + nbytes(w2),
                "max_rel_error": round(check_accuracy(shape, w13, w2, gen), 5),
                "rows": [],
            }
            print(f"{name} {kind}: max relative error {entry['max_rel_error']}")
            print(f"{'M':>5} {'us':>9} {'route':>7} {'experts':>7} {'GB/s':>8} {'TFLOP/s':>8} {'roofline':>9}")
            for m in args.batch_sizes or BATCH_SIZES:
                if time.monotonic() > deadline:
                    print(f"time limit reached at M={m}")
                    entry["truncated_at_m"] = m
                    break
                row = measure(shape, w13, w2, m, args.rep_ms, gen)
                entry["rows"].append(row)
                print(
                    f"{m:>5} {row['us']:>9.1f} {row['route_us']:>7.1f} {row['experts_touched']:>7} "
                    f"{row['gbs']:>8.0f} {row['tflops']:>8.1f} {row['roofline_us']:>9.1f}"
                )
            results.append(entry)
            del w13, w2
            torch.cuda.empty_cache()
    return results


def write_chart(path: str, results: list[dict[str, Any]]) -> None:
    """GB/s and TFLOP/s against the batch size, one line per shape and kind. Optional: without
    matplotlib there is no chart."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_fl) = plt.subplots(1, 2, figsize=(11, 4))
    for entry in results:
        ms = [r["m"] for r in entry["rows"]]
        label = f"{entry['shape']} {entry['kind']}"
        ax_bw.plot(ms, [r["gbs"] for r in entry["rows"]], marker="o", label=label)
        ax_fl.plot(ms, [r["tflops"] for r in entry["rows"]], marker="o", label=label)
    for ax, peak, unit in ((ax_bw, PEAK_GBS, "GB/s"), (ax_fl, PEAK_TFLOPS, "TFLOP/s")):
        ax.axhline(peak, color="grey", linestyle="--", label=f"H200 peak {peak:g} {unit}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size M (tokens)")
        ax.set_ylabel(f"achieved {unit}")
        ax.legend(fontsize=7)
    ax_fl.set_yscale("log")
    fig.suptitle("Ember fused MoE kernel (routing excluded), achieved vs peak", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument(
        "--kinds", nargs="+", choices=KINDS, default=["bf16"], help="expert storage: bf16 or a --quantization kind"
    )
    ap.add_argument(
        "--batch-sizes", type=int, nargs="+", help=f"default {BATCH_SIZES}; with --fused {FUSED_BATCH_SIZES}"
    )
    ap.add_argument("--fused", action="store_true", help="per layer: the two-GEMM path vs the one-kernel MLP")
    ap.add_argument(
        "--fused-tiles",
        type=int,
        nargs=5,
        action="append",
        default=[],
        metavar=("BLOCK_I", "BLOCK_K", "BLOCK_H", "WARPS", "STAGES"),
        help="with --fused, a tile set to time (repeatable); default the runtime's default_fused_tiles",
    )
    ap.add_argument("--rep-ms", type=int, default=50, help="milliseconds of graph replays per measurement")
    ap.add_argument(
        "--time-limit",
        type=float,
        default=240.0,
        help="seconds; past it the remaining measurements are skipped and the results written",
    )
    ap.add_argument(
        "--out",
        default=os.path.join(RESULTS_DIR, f"moe-kernel-cuda-{today()}.json"),
        help="JSON path; a PNG chart goes next to it if matplotlib is installed",
    )
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_kernel.py times the Triton kernels on a CUDA GPU; none is visible")
    machine = machine_info()
    results = run_fused(args) if args.fused else run(args)
    write_json(
        args.out,
        {
            "benchmark": "moe_kernel_fused" if args.fused else "moe_kernel",
            "date": today(),
            "machine": machine,
            "command": sys.argv,
            "config": {**vars(args), "peak_gbs": PEAK_GBS, "peak_tflops": PEAK_TFLOPS},
            "results": results,
        },
    )
    if not args.fused:
        write_chart(os.path.splitext(args.out)[0] + ".png", results)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
