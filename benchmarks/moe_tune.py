"""Search the fused MoE kernels' tile configs on this GPU and write them to the config table.

For each layer shape (Qwen3-30B-A3B, Mixtral-8x7B) and batch size M, and each BLOCK_M that suits
M's slots per expert, times every candidate tile of the gate_up GEMM and of the down GEMM alone
(each in a CUDA graph) on one routed batch, keeps the fastest of each, and keeps the BLOCK_M whose
pair is fastest. The winner and the heuristic default are then timed as the whole fused_moe, and
the winner goes into ember/kernels/moe_configs.json under this GPU's name (merged with what is
there) only when it beats the default. At M = 1 the down GEMM + sum_topk is also set against
down_by_token (the two in one kernel), whose fastest tiles join the entry only when they win.
Small batch sizes go first and an internal time limit stops the search, so a short run still
tunes decode; a config that fails to compile (shared memory) is skipped.

    python benchmarks/moe_tune.py --time-limit 170 --out benchmarks/results/moe-tune-h200-<date>.json
    python benchmarks/moe_tune.py --shapes qwen3-30b-a3b --batch-sizes 1 2 3 4 5 6 7 8 --time-limit 55

The second is decode alone (one BLOCK_M, kernels compiled once for all M): about 80 s on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from benchmarks.moe_kernel import KINDS, SHAPES, MoeShape, bench_us, make_batch, make_experts
from ember.kernels.fused_moe import Experts, down_by_token, fused_moe, grouped_gemm, sum_topk, weight_kind
from ember.kernels.moe_align import moe_align_block_size
from ember.kernels.moe_config import (
    TABLE_PATH,
    GemmTiles,
    MoeConfig,
    default_moe_config,
    device_key,
    fit_tiles,
    problem_key,
)
from ember.quant.experts import QuantizedExperts

TUNE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
# (BLOCK_N, BLOCK_K, warps, stages), six each: a cold GPU machine compiles every one per BLOCK_M
# (about a second each), which bounds the search more than the timing does. Few rows per block:
# the weight stream dominates, so long K tiles, narrow N tiles (more programs) and deep pipelines;
# many rows: square-ish compute tiles.
SMALL_M_TILES = [
    GemmTiles(16, 256, 4, 4),
    GemmTiles(16, 128, 2, 6),
    GemmTiles(32, 128, 4, 4),
    GemmTiles(32, 128, 2, 5),
    GemmTiles(32, 256, 4, 3),
    GemmTiles(64, 128, 4, 3),
    GemmTiles(64, 128, 4, 4),
    GemmTiles(128, 128, 8, 3),
]
# M = 1's down GEMM fused with the sum over k (fused_moe.down_by_token): one program per N tile of
# H, so narrow tiles give the programs (H / BLOCK_N: 256 at Qwen3-30B-A3B's H = 2048 and BLOCK_N 8)
# that keep the weight stream in flight.
BY_TOKEN_TILES = [
    GemmTiles(8, 256, 4, 4),
    GemmTiles(8, 128, 2, 4),
    GemmTiles(16, 256, 4, 4),
    GemmTiles(16, 128, 4, 6),
    GemmTiles(32, 256, 8, 3),
]
LARGE_M_TILES = [
    GemmTiles(64, 64, 4, 3),
    GemmTiles(64, 64, 4, 4),
    GemmTiles(128, 64, 4, 3),
    GemmTiles(128, 64, 8, 3),
    GemmTiles(64, 128, 4, 3),
    GemmTiles(128, 128, 8, 3),
]


def block_m_candidates(m: int, shape: MoeShape) -> list[int]:
    """Powers of two from 16 up to about twice the mean slots per expert (at most 128)."""
    mean = m * shape.top_k / shape.num_experts
    return [b for b in (16, 32, 64, 128) if b == 16 or b <= 2 * mean]


def time_tiles(fn, tiles: GemmTiles, rep_ms: int) -> float | None:
    try:
        return bench_us(lambda: fn(tiles), rep_ms)
    except Exception as exc:  # noqa: BLE001 - a config the GPU cannot run (shared memory, registers) is skipped
        print(f"    skip {tuple(tiles)}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        return None


def best_tiles(
    fn, candidates: list[GemmTiles], n: int, k: int, w: Experts, rep_ms: int
) -> tuple[GemmTiles, float] | None:
    """The fastest candidate, each fitted to the problem as the runtime will fit it (K tiles inside
    a quantization group)."""
    group = w.group_size if isinstance(w, QuantizedExperts) else None
    fitted = list(dict.fromkeys(fit_tiles(t, n, k, group) for t in candidates))
    timed = [(t, us) for t in fitted if (us := time_tiles(fn, t, rep_ms)) is not None]
    return min(timed, key=lambda r: r[1]) if timed else None


def tune_point(
    shape: MoeShape, w13: Experts, w2: Experts, m: int, rep_ms: int, gen: torch.Generator, deadline: float
) -> dict[str, Any]:
    """The fastest config found for one batch; past the deadline no further BLOCK_M is tried."""
    hidden, weights, ids = make_batch(shape, m, gen)
    slots = m * shape.top_k
    act = torch.empty(slots, shape.inter, dtype=hidden.dtype, device=hidden.device)
    y = torch.empty(slots, shape.hidden, dtype=hidden.dtype, device=hidden.device)
    route_w = weights.view(-1)
    best = None
    for block_m in block_m_candidates(m, shape):
        if best is not None and time.monotonic() > deadline:
            break
        align = moe_align_block_size(ids, shape.num_experts, block_m)
        cands = SMALL_M_TILES if block_m <= 32 else LARGE_M_TILES
        up = best_tiles(
            lambda t, a=align: grouped_gemm(hidden, w13, act, a, t, shape.top_k),
            cands,
            shape.inter,
            shape.hidden,
            w13,
            rep_ms,
        )
        down = best_tiles(
            lambda t, a=align: grouped_gemm(act, w2, y, a, t, 1, route_w), cands, shape.hidden, shape.inter, w2, rep_ms
        )
        if up is None or down is None:
            continue
        if best is None or up[1] + down[1] < best[1]:
            best = (MoeConfig(block_m, up[0], down[0]), up[1] + down[1])
    if m == 1 and best is not None:
        best = with_down_by_token(best, shape, hidden, w13, w2, weights, ids, rep_ms)
    default = default_moe_config(slots, shape.num_experts)
    default_us = bench_us(lambda: fused_moe(hidden, w13, w2, weights, ids, config=default), rep_ms)
    if best is None:
        return {"m": m, "default": default.to_json(), "default_us": round(default_us, 2), "tuned": None}
    tuned_us = bench_us(lambda: fused_moe(hidden, w13, w2, weights, ids, config=best[0]), rep_ms)
    return {
        "m": m,
        "default": default.to_json(),
        "default_us": round(default_us, 2),
        "tuned": best[0].to_json(),
        "tuned_us": round(tuned_us, 2),
        "gemms_us": round(best[1], 2),
    }


def with_down_by_token(
    best: tuple[MoeConfig, float],
    shape: MoeShape,
    hidden: torch.Tensor,
    w13: Experts,
    w2: Experts,
    weights: torch.Tensor,
    ids: torch.Tensor,
    rep_ms: int,
) -> tuple[MoeConfig, float]:
    """At M = 1: `best` with the fastest down_by_token tiles when those beat its down GEMM plus
    sum_topk (the two launches they replace), timed on the same routed token."""
    cfg = best[0]
    align = moe_align_block_size(ids, shape.num_experts, cfg.block_m)
    act = torch.empty(shape.top_k, shape.inter, dtype=hidden.dtype, device=hidden.device)
    grouped_gemm(hidden, w13, act, align, cfg.gate_up, shape.top_k)
    y = torch.empty(shape.top_k, shape.hidden, dtype=hidden.dtype, device=hidden.device)
    route_w = weights.view(-1)
    two_step_us = bench_us(
        lambda: (grouped_gemm(act, w2, y, align, cfg.down, 1, route_w), sum_topk(y, shape.top_k)), rep_ms
    )
    fused = best_tiles(
        lambda t: down_by_token(act, w2, weights, ids, t), BY_TOKEN_TILES, shape.hidden, shape.inter, w2, rep_ms
    )
    print(
        f"    M=1 down + sum_topk {two_step_us:.1f} us, down_by_token {fused and (tuple(fused[0]), round(fused[1], 1))}"
    )
    if fused is None or fused[1] >= two_step_us:
        return best
    return cfg._replace(down_by_token=fused[0]), best[1] - two_step_us + fused[1]


def merge_table(path: str, device: str, entries: dict[str, dict[str, Any]]) -> None:
    """Add this run's winners to the table at `path`, keeping other GPUs' and problems' entries."""
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    except (OSError, ValueError):
        table = {}
    for key, sizes in entries.items():
        table.setdefault(device, {}).setdefault(key, {}).update(sizes)
    table = {
        dev: {key: dict(sorted(sizes.items(), key=lambda kv: int(kv[0]))) for key, sizes in sorted(problems.items())}
        for dev, problems in sorted(table.items())
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1)
        f.write("\n")


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    deadline = time.monotonic() + args.time_limit
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = {(name, kind): make_experts(SHAPES[name], kind, gen) for name in args.shapes for kind in args.kinds}
    rows, entries = [], {}
    for m in args.batch_sizes:  # small M first: decode matters most and a short run must cover it
        for (name, kind), (w13, w2) in experts.items():
            if time.monotonic() > deadline:
                print(f"time limit reached: {name} {kind} M={m} not tuned")
                continue
            shape = SHAPES[name]
            row = {"shape": name, "kind": kind, **tune_point(shape, w13, w2, m, args.rep_ms, gen, deadline)}
            rows.append(row)
            print(
                f"{name} {kind} M={m}: default {row['default_us']} us, tuned {row.get('tuned_us')} us {row['tuned']}",
                flush=True,
            )
            if row["tuned"] is not None and row["tuned_us"] < row["default_us"]:
                key = problem_key(shape.num_experts, shape.hidden, shape.inter, weight_kind(w13))
                entries.setdefault(key, {})[str(m)] = row["tuned"]
    return rows, entries


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=["bf16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=TUNE_SIZES)
    ap.add_argument("--rep-ms", type=int, default=10, help="milliseconds of graph replays per candidate")
    ap.add_argument(
        "--time-limit",
        type=float,
        default=170.0,
        help="seconds; past it no new (shape, M) point starts and what was tuned is written",
    )
    ap.add_argument("--table", default=TABLE_PATH, help="config table to merge the winners into")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, f"moe-tune-cuda-{today()}.json"))
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_tune.py tunes the Triton kernels on a CUDA GPU; none is visible")
    machine = machine_info()
    rows, entries = run(args)
    device = device_key(torch.device("cuda"))
    merge_table(args.table, device, entries)
    write_json(
        args.out,
        {
            "benchmark": "moe_tune",
            "date": today(),
            "machine": machine,
            "command": sys.argv,
            "config": {**vars(args), "device": device},
            "results": rows,
        },
    )
    print(f"wrote {sum(len(v) for v in entries.values())} entries for {device} to {args.table}; results to {args.out}")


if __name__ == "__main__":
    main()
