"""The native CPU kernels (ember/cpu_native) against the PyTorch ops they replace, on the default
model's shapes (SmolLM2-135M: hidden 576, intermediate 1536, 9 query and 3 KV heads of 64).

- `gemv`: one decode step's int4 matmuls (30 layers of fused qkv 960x576, o 576x576, gate/up
  3072x576, down 576x1536, Q4_1-like groups of 32 with zeros) from DRAM, per row count: the native
  GEMV, and PyTorch's `_weight_int4pack_mm_for_cpu` with bf16 activations (the fallback);
- `crossover`: one layer's int4 weights in cache, the native GEMV against the expansion plus oneDNN's
  GEMM (`--crossover-rows`), in float32 and (AVX512_BF16) bf16 arithmetic, which sets
  `NATIVE_EXPAND_MIN_ROWS`;
- `head`: the 49152 x 576 int8 (Q8_0-like) LM head: native GEMV against the bf16 `F.linear` the
  fallback's screen runs;
- `attention`: decode attention over 30 layers' paged float32 caches (block 16, shuffled tables):
  native against the fallback's gather + SDPA (ember.ops.attention's `TorchAttention.decode`);
- `lora`: one decode step's LoRA deltas (`ops.lora_delta`, 120 projections: fused qkv, o, fused gate/up,
  down) of the rows dealt round-robin over 4 rank-16 slots (78 MB of float32 adapters, from DRAM), in
  float32 and bfloat16 slots, against PyTorch's one-hot form (`TorchLoRA`, the fallback).

Minimum over `--repeats` of each. Wall times: meaningful on a quiet machine only (check `loadavg`).

    python benchmarks/cpu_native_kernels.py --rows 1 16 --seq-lens 256
    python benchmarks/cpu_native_kernels.py --kernels lora --rows 1 16 --repeats 15
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from ember.cpu_native import ops
from ember.model.linear import QuantLinear
from ember.ops import attention, lora
from ember.quant.formats import QuantizedWeight, pack_int4

LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) per layer
HEAD = (49152, 576)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LORA_SLOTS, LORA_RANK = 4, 16
LORA_PROJECTIONS = [(576, [576, 192, 192]), (576, [576]), (576, [1536, 1536]), (1536, [576])]  # (K, slice widths)
KERNELS = ("gemv", "crossover", "head", "attention", "lora")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16], help="activation rows (batch size)")
    p.add_argument(
        "--crossover-rows",
        type=int,
        nargs="*",
        default=[16, 32, 64, 128, 256, 512],
        help="activation rows for the GEMV-against-expansion comparison",
    )
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256], help="keys per sequence for attention")
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS, help="which comparisons to run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/cpu-native-kernels-<date>.json)")
    return p.parse_args(argv)


def best_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(min(times) * 1e3, 3)


def _int4(n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    codes = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
    return QuantizedWeight(
        "int4",
        codes,
        (torch.rand(n, k // 32, generator=gen) * 0.01).half().float(),
        (torch.randn(n, k // 32, generator=gen) * 0.01).half().float(),
        32,
        k,
    )


def _layers(native: bool, gen: torch.Generator) -> list[QuantLinear]:
    os.environ["EMBER_CPU_NATIVE"] = "1" if native else "0"
    return [QuantLinear([_int4(n, k, gen)], None, torch.float32) for _ in range(LAYERS) for n, k in LAYER_SHAPES]


def gemv(rows: list[int], repeats: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    layers = {"native": _layers(True, gen), "pytorch": _layers(False, gen)}
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
        row = {"rows": m}
        for name, mods in layers.items():
            row[f"{name}_ms"] = best_ms(
                lambda mods=mods, xs=xs: [mod(xs[k]) for mod, (_, k) in zip(mods, LAYER_SHAPES * LAYERS)], repeats
            )
        out.append(row)
    return out


def crossover(rows: list[int], repeats: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(3)
    weights = [_int4(n, k, gen) for n, k in LAYER_SHAPES]
    os.environ["EMBER_CPU_NATIVE"] = "1"  # `gemv` leaves the PyTorch path selected
    arithmetics = ["float32", "bf16"] if ops.has_bf16() else ["float32"]
    out = []
    for m in rows:
        xs = [torch.randn(m, w.in_features, generator=gen) for w in weights]
        for arithmetic in arithmetics:
            nats = [ops.native_weight(w, bf16=arithmetic == "bf16") for w in weights]
            out.append(
                {
                    "rows": m,
                    "arithmetic": arithmetic,
                    "native_ms": best_ms(
                        lambda xs=xs, nats=nats: [ops.matmul(x, w) for x, w in zip(xs, nats)], repeats
                    ),
                    "expanded_ms": best_ms(
                        lambda xs=xs, nats=nats: [
                            F.linear(x.to(torch.bfloat16 if w.bf16 else torch.float32), ops.dequantize(w))
                            for x, w in zip(xs, nats)
                        ],
                        repeats,
                    ),
                }
            )
    return out


def head(rows: list[int], repeats: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(1)
    n, k = HEAD
    w = QuantizedWeight(
        "int8",
        torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
        torch.rand(n, k // 32, generator=gen) * 0.01,
        None,
        32,
        k,
    )
    native = ops.native_weight(w)
    bf16 = ops.dequantize(native).bfloat16()
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=gen)
        out.append(
            {
                "rows": m,
                "native_ms": best_ms(lambda x=x: ops.matmul(x, native), repeats),
                "bf16_mm_ms": best_ms(lambda x=x: F.linear(x.bfloat16(), bf16), repeats),
            }
        )
    return out


def _decode_metadata(tables: torch.Tensor, lens: torch.Tensor) -> attention.AttentionMetadata:
    nd = lens.shape[0]
    return attention.AttentionMetadata(
        torch.zeros(nd, dtype=torch.long),
        tables,
        lens,
        torch.arange(nd + 1, dtype=torch.int32),
        nd,
        0,
        int(lens.max()),
        lens.tolist(),
        list(range(nd + 1)),
    )


def decode_attention(rows: list[int], seq_lens: list[int], repeats: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(2)
    out = []
    for nd in rows:
        for seq_len in seq_lens:
            per_seq = -(-seq_len // BLOCK)
            shape = (nd * per_seq, BLOCK, KV_HEADS, HEAD_DIM)
            caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(LAYERS)]
            tables = torch.randperm(nd * per_seq, generator=gen).to(torch.int32).view(nd, per_seq)
            lens = torch.full((nd,), seq_len, dtype=torch.int32)
            q = torch.randn(nd, HEADS, HEAD_DIM, generator=gen)
            row = {"sequences": nd, "seq_len": seq_len}
            for name, impl in (("native", attention.NativeDecodeAttention()), ("pytorch", attention.TorchAttention())):
                meta = _decode_metadata(tables, lens)  # one per step, shared by the layers, as in the engine
                row[f"{name}_ms"] = best_ms(
                    lambda meta=meta, q=q, caches=caches, impl=impl: [
                        impl.decode(q, k, v, meta, HEAD_DIM**-0.5, 1.0, 1.0, attention.Masking()) for k, v in caches
                    ],
                    repeats,
                )
            out.append(row)
    return out


def _lora_step(fn: Callable[..., None], weights: list, offsets: list, xs: dict, ys: list, slots: torch.Tensor) -> None:
    """One decode step's deltas: each projection's x [rows, K] through its slots into its y."""
    for i, (w, (k, _)) in enumerate(zip(weights, LORA_PROJECTIONS * LAYERS)):
        fn(xs[k], ys[i % len(LORA_PROJECTIONS)], w, offsets[i], slots)


def lora_deltas(rows: list[int], repeats: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(4)
    slots = [
        (
            (torch.randn(LORA_SLOTS, len(widths) * LORA_RANK, k, generator=gen) * 0.05),
            [torch.randn(LORA_SLOTS, LORA_RANK, n, generator=gen) * 0.05 for n in widths],
        )
        for _ in range(LAYERS)
        for k, widths in LORA_PROJECTIONS
    ]
    offsets = [[sum(widths[:i]) for i in range(len(widths))] for _, widths in LORA_PROJECTIONS] * LAYERS
    forms = {
        "native_float32_ms": (slots, lambda x, y, w, o, s: ops.lora_delta(x, y, w, s)),
        "native_bf16_ms": (
            [(a.bfloat16(), [t.bfloat16() for t in b]) for a, b in slots],
            lambda x, y, w, o, s: ops.lora_delta(x, y, w, s),
        ),
        "pytorch_ms": (slots, lambda x, y, w, o, s: lora.TorchLoRA()(x, y, lora.LoRAWeights(w[0], w[1], o), s)),
    }
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
        ys = [torch.zeros(m, sum(widths)) for _, widths in LORA_PROJECTIONS]
        dealt = torch.arange(m, dtype=torch.int32) % LORA_SLOTS
        row: dict[str, Any] = {"rows": m}
        for name, (weights, fn) in forms.items():
            row[name] = best_ms(functools.partial(_lora_step, fn, weights, offsets, xs, ys, dealt), repeats)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not ops.available():
        print("the native kernels are not available (see the warning above)", file=sys.stderr)
        return 1
    results = {"loadavg_before": os.getloadavg(), "threads": torch.get_num_threads()}
    for name, fn in (
        ("gemv", lambda: gemv(args.rows, args.repeats)),
        ("crossover", lambda: crossover(args.crossover_rows, args.repeats)),
        ("head", lambda: head(args.rows, args.repeats)),
        ("attention", lambda: decode_attention(args.rows, args.seq_lens, args.repeats)),
        ("lora", lambda: lora_deltas(args.rows, args.repeats)),
    ):
        if name not in args.kernels:
            continue
        results[name] = fn()
        for row in results[name]:
            print(name, row, flush=True)
    os.environ.pop("EMBER_CPU_NATIVE", None)
    results["loadavg_after"] = os.getloadavg()
    out = args.out or os.path.join(RESULTS_DIR, f"cpu-native-kernels-{today()}.json")
    write_json(
        out,
        {
            "benchmark": "cpu_native_kernels",
            "date": today(),
            "machine": machine_info(),
            "command": sys.argv,
            "config": vars(args),
            "results": results,
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
