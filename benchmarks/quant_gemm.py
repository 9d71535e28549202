"""Quantized GEMM timings on the GPU: which kernel serves which batch size.

For every weight shape of a model (Llama-3.1-8B by default) and every row count M, times bf16
cuBLAS, the fused dequantizing Triton GEMM (int8, int4), dequantize-then-cuBLAS (int8, int4) and
fp8 `torch._scaled_mm` (with its per-token activation quantization), and for M <= 16 a sweep of
the fused kernel's tile configs. The crossover where dequantize + cuBLAS wins sets
`ember.quant.linear.GPU_FUSED_MAX_ROWS`; the best small-M configs feed the kernel's tile table.

    python benchmarks/quant_gemm.py --out benchmarks/results/quant-gemm-h200-<date>.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json  # noqa: E402
from ember.kernels.quant_matmul import (  # noqa: E402
    QuantMatmulConfig, choose_quant_matmul_config, dequantize_kernel, quant_matmul,
)
from ember.quant.linear import _fp8_matmul  # noqa: E402
from ember.quant.quantize import quantize  # noqa: E402

# (name, N, K) of Llama-3.1-8B's linear layers (q/k/v and gate/up fused as Ember runs them)
SHAPES_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
ROWS = [1, 4, 16, 64, 256, 1024, 4096]
SWEEP_ROWS = (1,)
SWEEP = [QuantMatmulConfig(16, bn, 128, sk, 4, 4) for bn in (32, 64, 128) for sk in (1, 2, 4, 8)]


def default_config(m: int, n: int, k: int, group_size: int) -> dict:
    return choose_quant_matmul_config(m, n, k, group_size, 132)._asdict()


def bench_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=40) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS)
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, f"quant-gemm-cuda-{today()}.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    print(f"{'shape':>8} {'M':>5} " + " ".join(f"{c:>12}" for c in
          ("bf16", "int8_fused", "int8_deq", "int4_fused", "int4_deq", "fp8", "int8_best", "int4_best")) + "   (us)")
    for name, n, k in SHAPES_8B:
        w = torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02
        qw = {kind: quantize(w, kind) for kind in ("int8", "int4", "fp8")}
        for m in args.rows:
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
            t = {"bf16": bench_us(lambda: F.linear(x, w)), "fp8": bench_us(lambda: _fp8_matmul(x, qw["fp8"]))}
            for kind in ("int8", "int4"):
                t[f"{kind}_fused"] = bench_us(lambda: quant_matmul(x, qw[kind]))
                t[f"{kind}_deq"] = bench_us(lambda: F.linear(x, dequantize_kernel(qw[kind], x.dtype)))
            row = {"shape": name, "n": n, "k": k, "m": m, "us": {c: round(v, 2) for c, v in t.items()},
                   "default_config": {kind: default_config(m, n, k, qw[kind].group_size)
                                      for kind in ("int8", "int4")}}
            if args.sweep and m in SWEEP_ROWS:
                for kind in ("int8", "int4"):
                    best = min(((bench_us(lambda c=c: quant_matmul(x, qw[kind], config=c)), c) for c in SWEEP),
                               key=lambda r: r[0])
                    row[f"{kind}_best"] = {"us": round(best[0], 2), "config": best[1]._asdict()}
            rows_out.append(row)
            best = [row.get(f"{kind}_best", {}).get("us", float("nan")) for kind in ("int8", "int4")]
            print(f"{name:>8} {m:>5} " + " ".join(f"{t[c]:>12.1f}" for c in
                  ("bf16", "int8_fused", "int8_deq", "int4_fused", "int4_deq", "fp8")) +
                  "".join(f" {b:>12.1f}" for b in best))
    weight_bytes = {name: n * k for name, n, k in SHAPES_8B}
    write_json(args.out, {"benchmark": "quant_gemm", "date": today(), "machine": machine_info(),
                          "command": sys.argv, "config": {**vars(args), "int8_weight_bytes": weight_bytes},
                          "results": rows_out})
    print("wrote", args.out)


if __name__ == "__main__":
    main()
