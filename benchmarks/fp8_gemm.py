"""fp8 (W8A8) GEMM timings on the GPU: which kernel serves block-scaled weights at which batch size.

For Llama-3.1-8B's weight shapes and every row count M, times a whole fp8 layer as QuantLinear runs
it, activation quantization included: bf16 cuBLAS (the baseline), per-channel weights with per-token
activations through cuBLAS's row-wise `torch._scaled_mm` (`ptpc_fp8`), block-scaled weights (128x128)
with 1x128 activation groups through the Triton block GEMM and through cuBLAS's blockwise
`torch._scaled_mm` where this PyTorch/cuBLAS supports it. Each path's result is checked against the
float64 product once per shape. For M <= 16 it also sweeps the Triton GEMM's tile and split-K
choices, for M >= 256 its tiles. It prints the crossover for
`ember.ops.linear_gpu.FP8_BLOCK_SCALED_MM_MIN_ROWS` (the smallest M from which blockwise `_scaled_mm`
beats the Triton GEMM on every shape, at that M and every larger one) and the best configs for the
kernel's tile table.

    python benchmarks/fp8_gemm.py --out benchmarks/results/fp8-gemm-cuda-<date>.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, cuda_graph_us, machine_info, today, write_json
from ember.kernels.fp8_matmul import (
    Fp8MatmulConfig,
    choose_fp8_matmul_config,
    fp8_block_matmul,
    fp8_block_matmul_ref,
    quantize_fp8_groups,
)
from ember.quant.quantize import quantize_fp8, quantize_fp8_per_channel

# (name, N, K) of Llama-3.1-8B's linear layers (q/k/v and gate/up fused as Ember runs them)
SHAPES_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
ROWS = [1, 4, 16, 64, 256, 1024, 4096]
SMALL_SWEEP = [
    Fp8MatmulConfig(16, bn, sk, w, st) for bn in (32, 64, 128) for sk in (1, 2, 4, 8) for w, st in ((4, 4), (4, 6))
]
LARGE_SWEEP = [
    Fp8MatmulConfig(bm, bn, 1, w, st)
    for bm, bn, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (128, 256, 8))
    for st in (3, 4)
]


def sweep_configs(m: int) -> list[Fp8MatmulConfig]:
    """Tile candidates for the rows the kernel's table distinguishes: decode sizes and large batches."""
    return SMALL_SWEEP if m <= 16 else LARGE_SWEEP if m >= 256 else []


PATHS = ("bf16", "ptpc_scaled_mm", "block_triton", "block_scaled_mm")


def bench_us(fn) -> float:
    return cuda_graph_us(fn, 30)


def ptpc(x: torch.Tensor, w) -> torch.Tensor:
    xq, xs = quantize_fp8_groups(x, w.group_size)
    return torch._scaled_mm(xq, w.qweight.t(), scale_a=xs, scale_b=w.scales.t(), out_dtype=x.dtype)


def block_triton(x: torch.Tensor, w, config: Fp8MatmulConfig | None = None) -> torch.Tensor:
    xq, xs = quantize_fp8_groups(x, w.group_size)
    return fp8_block_matmul(xq, xs, w, x.dtype, config)


def block_scaled_mm(x: torch.Tensor, w) -> torch.Tensor:
    xq, xs = quantize_fp8_groups(x, w.group_size, column_major_scales=True)
    return torch._scaled_mm(xq, w.qweight.t(), scale_a=xs, scale_b=w.scales.t(), out_dtype=x.dtype)


def rel_error(out: torch.Tensor, x: torch.Tensor, w) -> float:
    """Against the float64 product of x's own fp8 codes and the weight (what every fp8 path computes)."""
    xq, xs = quantize_fp8_groups(x, w.group_size)
    ref = fp8_block_matmul_ref(xq, xs, w, torch.float64)
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def time_paths(x: torch.Tensor, dense: torch.Tensor, weights: dict, scaled_mm_ok: bool) -> dict[str, float | None]:
    t = {
        "bf16": bench_us(lambda: F.linear(x, dense)),
        "ptpc_scaled_mm": bench_us(lambda: ptpc(x, weights["ptpc"])),
        "block_triton": bench_us(lambda: block_triton(x, weights["block"])),
        "block_scaled_mm": _blockwise_us(x, weights["block"]) if scaled_mm_ok else None,
    }
    return {c: None if v is None else round(v, 2) for c, v in t.items()}


def _blockwise_us(x: torch.Tensor, w) -> float | None:
    """None where cuBLAS has no blockwise algorithm for this M (on the H200 with CUDA 13: M = 1)."""
    try:
        return bench_us(lambda: block_scaled_mm(x, w))
    except RuntimeError as e:
        print(f"blockwise _scaled_mm, M={x.shape[0]}: {str(e)[:120]}")
        return None


def check_paths(x: torch.Tensor, weights: dict) -> tuple[dict[str, float | str], bool]:
    """Each fp8 path's relative error (or the error it raised) on one M; whether blockwise _scaled_mm runs."""
    errors: dict[str, float | str] = {
        "ptpc_scaled_mm": rel_error(ptpc(x, weights["ptpc"]), x, weights["ptpc"]),
        "block_triton": rel_error(block_triton(x, weights["block"]), x, weights["block"]),
    }
    try:
        errors["block_scaled_mm"] = rel_error(block_scaled_mm(x, weights["block"]), x, weights["block"])
    except (RuntimeError, ValueError) as e:
        errors["block_scaled_mm"] = f"{type(e).__name__}: {str(e)[:200]}"
    ok = isinstance(errors["block_scaled_mm"], float) and errors["block_scaled_mm"] < 1e-2
    return {c: round(v, 6) if isinstance(v, float) else v for c, v in errors.items()}, ok


def crossover(rows_out: list[dict]) -> int | None:
    """The smallest M from which blockwise _scaled_mm beats the Triton GEMM on every shape at every M."""
    wins = {}
    for r in rows_out:
        us = r["us"]
        won = us["block_scaled_mm"] is not None and us["block_scaled_mm"] < us["block_triton"]
        wins[r["m"]] = wins.get(r["m"], True) and won
    ms = sorted(wins)
    for i, m in enumerate(ms):
        if all(wins[x] for x in ms[i:]):
            return m
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS)
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--time-limit", type=float, default=180.0, help="seconds; later shapes and sweeps are skipped")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, f"fp8-gemm-cuda-{today()}.json"))
    args = ap.parse_args()
    start = time.monotonic()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out, checks, skipped = [], {}, []
    print(f"{'shape':>8} {'M':>5} " + " ".join(f"{c:>16}" for c in PATHS) + f" {'triton_best':>12}   (us)")
    for name, n, k in SHAPES_8B:
        if time.monotonic() - start > args.time_limit:
            skipped.append(name)
            continue
        dense = torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02
        weights = {"ptpc": quantize_fp8_per_channel(dense), "block": quantize_fp8(dense)}
        x16 = torch.randn(16, k, device=dev, generator=gen, dtype=torch.bfloat16)
        checks[name], scaled_mm_ok = check_paths(x16, weights)
        print(f"{name:>8} relative errors {checks[name]}")
        for m in args.rows:
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
            row = {
                "shape": name,
                "n": n,
                "k": k,
                "m": m,
                "us": time_paths(x, dense, weights, scaled_mm_ok),
                "default_config": choose_fp8_matmul_config(m, n, k, 128, 132)._asdict(),
            }
            if args.sweep and sweep_configs(m) and time.monotonic() - start < args.time_limit:
                best = min(
                    (
                        (bench_us(lambda c=c, x=x, w=weights["block"]: block_triton(x, w, c)), c)
                        for c in sweep_configs(m)
                    ),
                    key=lambda r: r[0],
                )
                row["triton_best"] = {"us": round(best[0], 2), "config": best[1]._asdict()}
            rows_out.append(row)
            cells = " ".join(f"{'-' if row['us'][c] is None else round(row['us'][c], 1):>16}" for c in PATHS)
            print(f"{name:>8} {m:>5} {cells} {row.get('triton_best', {}).get('us', ''):>12}", flush=True)
    cross = crossover(rows_out)
    print(f"FP8_BLOCK_SCALED_MM_MIN_ROWS = {cross}  (None: the Triton GEMM at every M)")
    if skipped:
        print(f"time limit: skipped {skipped}")
    write_json(
        args.out,
        {
            "benchmark": "fp8_gemm",
            "date": today(),
            "machine": machine_info(),
            "command": sys.argv,
            "config": {**vars(args), "skipped_shapes": skipped},
            "results": {"rows": rows_out, "relative_errors": checks, "fp8_block_scaled_mm_min_rows": cross},
        },
    )
    print("wrote", args.out)


if __name__ == "__main__":
    main()
