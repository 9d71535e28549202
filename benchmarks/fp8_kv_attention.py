"""fp8 KV cache kernel timings on the GPU: decode attention, prefill attention and the KV store over a
bf16 cache against an fp8 one (layer scales and per-head scales), on the Qwen3-0.6B attention shape.

An fp8 cache halves the bytes decode attention reads, so its decode kernel should take at most the
bf16 cache's time; `throughput.py --kv-cache-dtype fp8` measures what that gives end to end.

    python benchmarks/fp8_kv_attention.py --out benchmarks/results/fp8-kv-attention-cuda-<date>.json

`--sweep` also times the decode kernel at each candidate tile (`decode_attention.TILES`: tokens per tile,
warps, stages) for both caches, at the run's batch and context and at batch 1 over 8,192 tokens (a
batch-1 decode step), and prints the fastest tile per cache.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, cuda_graph_us, machine_info, today, write_json
from ember.kernels import decode_attention, paged_decode_attention, paged_prefill_attention, store_kv
from ember.quant.formats import FP8_DTYPE

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 8, 2, 128, 16  # Qwen3-0.6B


def bench_us(fn) -> float:
    return cuda_graph_us(fn, 40)


SWEEP_TILES = [
    decode_attention.DecodeTile(*t)
    for t in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 4, 3), (128, 8, 2), (256, 8, 2))
]


def paged_cache(cache_dtype: torch.dtype, batch: int, context: int):
    """Random K/V caches of `batch` sequences of `context` tokens in shuffled blocks: (k, v, tables, lens)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=dev, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, device=dev, generator=gen).to(cache_dtype)
    tables = torch.randperm(num_blocks - 1, device=dev, generator=gen)[: batch * blocks_per_seq] + 1
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    return k_cache, v_cache, tables.view(batch, blocks_per_seq).int(), lens


def decode_timer(cache_dtype: torch.dtype, scales: dict, batch: int, context: int):
    """A callable that runs one decode-attention call over a fresh random cache of `batch` x `context`."""
    k_cache, v_cache, tables, lens = paged_cache(cache_dtype, batch, context)
    q = torch.randn(batch, NUM_KV_HEADS * GROUP, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    scale = HEAD_DIM**-0.5
    return lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, max_seq_len=context, **scales)


def sweep(caches: dict, shapes: list[tuple[int, int]]) -> dict:
    """Decode microseconds per (cache, batch x context, tile); TILES is restored afterwards."""
    saved = dict(decode_attention.TILES)
    out: dict = {}
    try:
        for name, (dtype, scales) in caches.items():
            width = torch.empty((), dtype=dtype).element_size()
            for batch, context in shapes:
                fn = decode_timer(dtype, scales, batch, context)
                row = out.setdefault(name, {}).setdefault(f"{batch}x{context}", {})
                for tile in SWEEP_TILES:
                    decode_attention.TILES[width] = tile
                    row["/".join(map(str, tile))] = round(bench_us(fn), 2)
                best = min(row, key=row.get)
                print(f"{name:>13} {batch}x{context}: " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()))
                print(f"{'':>13} fastest {best} ({row[best]:.1f} us)", flush=True)
    finally:
        decode_attention.TILES.update(saved)
    return out


def time_cache(
    cache_dtype: torch.dtype, scales: dict, batch: int, context: int, chunks: int, chunk_len: int
) -> dict[str, float]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    k_cache, v_cache, tables, lens = paged_cache(cache_dtype, batch, context)
    qp = torch.randn(
        chunks * chunk_len, NUM_KV_HEADS * GROUP, HEAD_DIM, device=dev, generator=gen, dtype=torch.bfloat16
    )
    starts = torch.arange(chunks + 1, device=dev, dtype=torch.int32) * chunk_len
    new = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, device=dev, generator=gen, dtype=torch.bfloat16)
    slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device=dev, generator=gen)[:batch]
    scale = HEAD_DIM**-0.5
    return {
        "decode_us": bench_us(decode_timer(cache_dtype, scales, batch, context)),
        "prefill_us": bench_us(
            lambda: paged_prefill_attention(
                qp, k_cache, v_cache, tables[:chunks], lens[:chunks], starts, chunk_len, scale, **scales
            )
        ),
        "store_us": bench_us(lambda: store_kv(new, new, k_cache, v_cache, slots, **scales)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256, help="decoding sequences")
    ap.add_argument("--context", type=int, default=1024, help="tokens per sequence (a multiple of 16)")
    ap.add_argument("--chunks", type=int, default=16, help="prefill chunks over the same contexts")
    ap.add_argument("--chunk-len", type=int, default=512)
    ap.add_argument("--sweep", action="store_true", help="time the decode kernel at each candidate tile")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, f"fp8-kv-attention-cuda-{today()}.json"))
    args = ap.parse_args()
    heads = torch.ones(NUM_KV_HEADS, device="cuda")
    caches = {
        "bf16": (torch.bfloat16, {}),
        "fp8": (FP8_DTYPE, {"k_scale": 1.0, "v_scale": 1.0}),
        "fp8_per_head": (FP8_DTYPE, {"k_scale": heads, "v_scale": heads.clone()}),
    }
    results = {}
    for name, (dtype, scales) in caches.items():
        results[name] = {
            k: round(v, 2)
            for k, v in time_cache(dtype, scales, args.batch, args.context, args.chunks, args.chunk_len).items()
        }
        print(f"{name:>13}: " + "  ".join(f"{k} {v:9.1f}" for k, v in results[name].items()), flush=True)
    if args.sweep:
        picked = {k: caches[k] for k in ("bf16", "fp8")}
        results["sweep"] = sweep(picked, [(args.batch, args.context), (1, 8192)])
    write_json(
        args.out,
        {
            "benchmark": "fp8_kv_attention",
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
