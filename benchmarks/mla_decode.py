"""MLA decode kernel against its bandwidth roofline (issue 34), over a bf16 latent cache and an fp8 one:
`mla_decode_attention` over a paged latent cache of batch x context tokens for each `--shapes` entry,
DeepSeek-V2-Lite's attention shape by default (16 heads, kv_lora_rank 512, rope 64; `--heads 128` is
V3's), and the store of one step's latent rows.

A decode step's MLA reads every cached row once (kv_lora_rank + rope values a token, one "head" for all
query heads), so its time is bounded below by those bytes over the card's memory bandwidth. The roofline
is taken two ways: the card's specified bandwidth (`SPEC_TBPS`, by GPU name) and a device-to-device copy
measured in the same run (what the memory system delivers to a streaming kernel). The query and output
bytes are counted too; they are under 1% of the cache at 256 x 2,048. An fp8 cache halves the bytes read
(576 a token instead of 1,152), so its decode should take at most the bf16 cache's time. Timings replay
a CUDA graph, as the engine does.

    python benchmarks/mla_decode.py                                   # 256 x 2,048 and more, V2-Lite heads
    python benchmarks/mla_decode.py --heads 128 --shapes 1x8192,64x2048 --out ...   # V3's 128 heads
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, bar_chart, cuda_graph_us, machine_info, today, write_json
from ember.kernels.mla_decode import mla_decode_attention, store_latent
from ember.quant.formats import FP8_DTYPE

# Specified HBM bandwidth, TB/s, by a part of the GPU's name (the SXM parts; a PCIe H100 has 2.0).
SPEC_TBPS = (("H200", 4.8), ("H100", 3.35), ("A100", 2.04))
BLOCK_SIZE = 16
CACHES = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE}


def bench_us(fn) -> float:
    return cuda_graph_us(fn, 100)


def copy_tbps() -> float:
    """Device-to-device copy of 1 GiB: bytes read plus bytes written per second."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / us / 1e6


def spec_tbps() -> float | None:
    name = torch.cuda.get_device_name()
    return next((tbps for part, tbps in SPEC_TBPS if part in name), None)


def latent_cache(batch: int, context: int, width: int, dtype: torch.dtype):
    """A random latent cache of `batch` x `context` rows in shuffled blocks: (cache, tables, lens)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    per_seq = context // BLOCK_SIZE
    num_blocks = batch * per_seq + 1
    cache = torch.randn(num_blocks, BLOCK_SIZE, 1, width, device="cuda", generator=gen).to(dtype)
    tables = torch.randperm(num_blocks - 1, device="cuda", generator=gen)[: batch * per_seq] + 1
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return cache, tables.view(batch, per_seq).int(), lens


def time_decode(dtype: torch.dtype, batch: int, context: int, heads: int, kv_lora: int, rope: int) -> dict[str, float]:
    """Decode microseconds and TB/s over one cache, and the store of `batch` rows into it."""
    width = kv_lora + rope
    cache, tables, lens = latent_cache(batch, context, width, dtype)
    q = torch.randn(batch, heads, width, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, heads, kv_lora, device="cuda", dtype=torch.bfloat16)
    rows = torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(cache.shape[0] * BLOCK_SIZE, device="cuda")[:batch]
    scale = (128 + rope) ** -0.5
    us = bench_us(lambda: mla_decode_attention(q, cache, tables, lens, scale, kv_lora, out=out, max_seq_len=context))
    nbytes = batch * context * width * cache.element_size() + q.numel() * 2 + out.numel() * 2
    store_us = bench_us(lambda: store_latent(rows, cache, slots))
    return {"us": round(us, 2), "bytes": nbytes, "tbps": round(nbytes / us / 1e6, 3), "store_us": round(store_us, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="256x2048,1x2048,256x16384", help="batch x context (a multiple of 16), ...")
    ap.add_argument("--caches", nargs="+", choices=sorted(CACHES), default=["bf16", "fp8"])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, f"mla-decode-cuda-{today()}.json"))
    args = ap.parse_args()
    copy, spec = copy_tbps(), spec_tbps()
    rows = []
    for shape in args.shapes.split(","):
        batch, context = (int(n) for n in shape.split("x"))
        for cache in args.caches:
            timed = time_decode(CACHES[cache], batch, context, args.heads, args.kv_lora_rank, args.rope_dim)
            row = {"cache": cache, "batch": batch, "context": context, **timed}
            row["of_copy"] = round(row["tbps"] / copy, 3)
            row["of_spec"] = round(row["tbps"] / spec, 3) if spec else None
            rows.append(row)
            print(
                f"{cache:>4} {batch:>4} x {context:>6}: {row['us']:9.1f} us  {row['tbps']:.2f} TB/s  "
                f"{100 * row['of_copy']:.0f}% of the copy's {copy:.2f} TB/s"
                + (f", {100 * row['of_spec']:.0f}% of the specified {spec} TB/s" if spec else "")
                + f"; store {row['store_us']:.1f} us",
                flush=True,
            )
    write_json(
        args.out,
        {
            "benchmark": "mla_decode",
            "date": today(),
            "machine": machine_info(),
            "command": " ".join(sys.argv),
            "shape": {"heads": args.heads, "kv_lora_rank": args.kv_lora_rank, "rope_dim": args.rope_dim},
            "copy_tbps": round(copy, 3),
            "spec_tbps": spec,
            "rows": rows,
            "target": ">= 70% of the bandwidth roofline at 256 x 2,048",
        },
    )
    png = os.path.splitext(args.out)[0] + ".png"
    lines = {f"copy {copy:.2f} TB/s": copy, **({f"spec {spec} TB/s": spec, "70% of spec": 0.7 * spec} if spec else {})}
    bars = {f"{r['cache']} {r['batch']} x {r['context']}": r["tbps"] for r in rows}
    shape = f"{args.heads} heads, latent {args.kv_lora_rank} + {args.rope_dim}"
    title = f"MLA decode, {shape}\n{torch.cuda.get_device_name()}"
    drew = bar_chart(png, bars, title, "TB/s read", lines)
    print(f"wrote {args.out}" + (f" and {png}" if drew else ""))


if __name__ == "__main__":
    main()
