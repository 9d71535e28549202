"""MLA decode kernel and latent store timings on the GPU over a bf16 latent cache against an fp8 one, on
DeepSeek-V3's attention shape (128 heads, a 512-wide latent and 64 rotated channels, blocks of 16).

An fp8 latent cache halves the bytes the decode kernel reads (576 a token instead of 1,152), so at long
contexts its decode should take at most the bf16 cache's time; the script also reports each run's
effective bandwidth (cache bytes read / time) to set against the GPU's peak. Decode timings replay a CUDA
graph, as the engine does.

    python benchmarks/mla_fp8_cache.py --out benchmarks/results/mla-fp8-cache-cuda-<date>.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from ember.kernels.mla_decode import mla_decode_attention, store_latent
from ember.quant.formats import FP8_DTYPE

HEADS, KV_LORA, ROPE, BLOCK_SIZE = 128, 512, 64, 16  # DeepSeek-V3
CACHES = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE}


def bench_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=40) * 1e3


def time_cache(cache_dtype: torch.dtype, batch: int, context: int) -> dict[str, float]:
    """Decode over `batch` sequences of `context` tokens in shuffled blocks, and a store of `batch` rows."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    width, blocks_per_seq = KV_LORA + ROPE, context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 1
    cache = torch.randn(num_blocks, BLOCK_SIZE, 1, width, device=dev, generator=gen).to(cache_dtype)
    tables = (torch.randperm(num_blocks - 1, device=dev, generator=gen)[: batch * blocks_per_seq] + 1).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HEADS, width, device=dev, generator=gen, dtype=torch.bfloat16)
    rows = torch.randn(batch, width, device=dev, generator=gen, dtype=torch.bfloat16)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=dev, generator=gen)[:batch]
    table = tables.view(batch, blocks_per_seq)
    decode_us = bench_us(lambda: mla_decode_attention(q, cache, table, lens, width**-0.5, KV_LORA, max_seq_len=context))
    read = batch * context * width * cache.element_size()
    return {
        "decode_us": round(decode_us, 2),
        "decode_tb_per_s": round(read / decode_us / 1e6, 2),
        "store_us": round(bench_us(lambda: store_latent(rows, cache, slots)), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1x8192,16x4096,64x2048,256x1024", help="batch x context, comma-separated")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, f"mla-fp8-cache-cuda-{today()}.json"))
    args = ap.parse_args()
    results: dict[str, dict[str, dict[str, float]]] = {}
    for shape in args.shapes.split(","):
        batch, context = (int(n) for n in shape.split("x"))
        for name, dtype in CACHES.items():
            row = time_cache(dtype, batch, context)
            results.setdefault(shape, {})[name] = row
            print(f"{shape:>10} {name:>5}: " + "  ".join(f"{k} {v:9.2f}" for k, v in row.items()), flush=True)
        ratio = results[shape]["fp8"]["decode_us"] / results[shape]["bf16"]["decode_us"]
        print(f"{shape:>10} fp8 / bf16 decode time: {ratio:.2f}x", flush=True)
    write_json(
        args.out,
        {
            "benchmark": "mla_fp8_cache",
            "date": today(),
            "machine": machine_info(),
            "command": sys.argv,
            "config": vars(args),
            "results": results,
        },
    )
    print("wrote", args.out)


if __name__ == "__main__":
    main()
