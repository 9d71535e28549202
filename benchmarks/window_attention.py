"""Paged attention kernel timings with and without a sliding window, on the Gemma-3-1B attention shape.

Decode (one query per sequence, split over the context) and prefill (fresh prompts) over a bf16 cache
of blocks of 16, 1 KV head of 256 and 4 query heads, at each context length: no window, a 512-token
window (Gemma 3's local layers), and a logit soft cap of 50 (Gemma 2's) without a window. A windowed
decode should cost about what a 512-token context costs whatever the length; the no-window rows are the
ones to compare with the same script run before the window existed (the constexpr switches leave that
kernel unchanged). Decode timings replay a CUDA graph, as the engine does.

    python benchmarks/window_attention.py --out benchmarks/results/window-attention-cuda-<date>.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, cuda_graph_us, machine_info, today, write_json
from ember.kernels import paged_decode_attention, paged_prefill_attention

BLOCK_SIZE, KV_HEADS, GROUP, HEAD_DIM = 16, 1, 4, 256
VARIANTS = {"none": {}, "window512": {"sliding_window": 512}, "softcap50": {"logits_soft_cap": 50.0}}


def bench_us(fn, graph: bool) -> float:
    import triton.testing

    return cuda_graph_us(fn, 50) if graph else triton.testing.do_bench(fn, rep=50) * 1e3


def paged_cache(batch: int, context: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = context // BLOCK_SIZE
    shape = (1 + batch * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    v = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    tables = torch.randperm(batch * blocks, device=dev).add_(1).to(torch.int32).view(batch, blocks)
    return k, v, tables


def decode_row(batch: int, context: int, dev: torch.device) -> dict:
    k, v, tables = paged_cache(batch, context, dev)
    q = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    out = torch.empty_like(q)
    us = {
        name: bench_us(
            lambda kw=kw: paged_decode_attention(
                q, k, v, tables, lens, HEAD_DIM**-0.5, out=out, max_seq_len=context, **kw
            ),
            graph=True,
        )
        for name, kw in VARIANTS.items()
    }
    return {"kernel": "decode", "batch": batch, "context": context, "us": {n: round(t, 1) for n, t in us.items()}}


def prefill_row(batch: int, context: int, dev: torch.device) -> dict:
    k, v, tables = paged_cache(batch, context, dev)
    q = torch.randn(batch * context, KV_HEADS * GROUP, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    starts = torch.arange(batch + 1, device=dev, dtype=torch.int32) * context
    us = {
        name: bench_us(
            lambda kw=kw: paged_prefill_attention(q, k, v, tables, lens, starts, context, HEAD_DIM**-0.5, **kw),
            graph=False,
        )
        for name, kw in VARIANTS.items()
    }
    return {"kernel": "prefill", "batch": batch, "context": context, "us": {n: round(t, 1) for n, t in us.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="*", default=[512, 4096, 8192, 32768])
    ap.add_argument("--decode-batches", type=int, nargs="*", default=[1, 16, 64])
    ap.add_argument("--prefill-batch", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, f"window-attention-cuda-{today()}.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    machine = machine_info()
    torch.manual_seed(0)
    rows = [decode_row(b, c, dev) for b in args.decode_batches for c in args.contexts]
    rows += [prefill_row(args.prefill_batch, c, dev) for c in args.contexts]
    print(f"{'kernel':>8} {'batch':>5} {'context':>7} " + " ".join(f"{n:>10}" for n in VARIANTS) + "   (us)")
    for r in rows:
        print(
            f"{r['kernel']:>8} {r['batch']:>5} {r['context']:>7} " + " ".join(f"{t:>10.1f}" for t in r["us"].values())
        )
    write_json(
        args.out,
        {
            "benchmark": "window_attention",
            "date": today(),
            "machine": machine,
            "command": sys.argv,
            "config": {
                **vars(args),
                "block_size": BLOCK_SIZE,
                "kv_heads": KV_HEADS,
                "group": GROUP,
                "head_dim": HEAD_DIM,
                "dtype": "bfloat16",
            },
            "results": rows,
        },
    )
    print("wrote", args.out)


if __name__ == "__main__":
    main()
