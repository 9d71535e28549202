"""Tile sizes of the fused MoE GEMMs: a tuned table per GPU and problem, a heuristic otherwise.

`benchmarks/moe_tune.py` measures configs on the GPU and writes moe_configs.json, keyed by device
name, then the problem ("E=128,H=2048,I=768,bfloat16"), then batch sizes M; a batch takes the
entry of the smallest tuned M at or above it (the largest tuned M beyond them). Anything missing
falls back to `default_moe_config`, so a new GPU, shape or tensor-parallel slice still runs.

The two GEMMs share BLOCK_M (the alignment pads each expert's slots to it) and tune their N/K
tiles, warps and stages apart: gate_up is [slots, H] x [H, 2I] with two accumulators, down is
[slots, I] x [I, H].
"""

from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import torch
import triton

# Batches up to this many tokens may run the fused MLP kernel, where the tuned table has a `fused` entry
# for the problem (benchmarks/moe_kernel.py --fused measures it against the two GEMMs): it is not yet
# measured on a GPU, so no entry exists and nothing takes it unasked. Its fp32 partials, k * I / BLOCK_I rows
# of H per token, grow with the batch while what it saves (a launch, the act round trip) does not:
# at 4 tokens of Qwen3-30B-A3B (BLOCK_I 32) 6 MiB written and read back, against ~270 MB of experts
# read; the sums fall to the last programs, so they lengthen the kernel's tail as they grow.
# Latency-bound decode batches are this small; larger ones keep the two GEMMs.
FUSED_MAX_TOKENS = 4
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_configs.json")


class GemmTiles(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


class FusedTiles(NamedTuple):
    """The one-kernel MLP's tiles: block_i rows of I per program (gate_up's N tile, down's K tile),
    block_k columns of H per gate_up K step, block_h rows of H per down step; each block_h chunk of a
    token's output is one counter, summed by its last program (more chunks: more atomics per
    program, shorter sums)."""

    block_i: int
    block_k: int
    block_h: int
    num_warps: int
    num_stages: int


class MoeConfig(NamedTuple):
    block_m: int
    gate_up: GemmTiles
    down: GemmTiles
    # At M = 1 only, where the tuner measured it faster: down and the sum over k in one kernel
    # (fused_moe.down_by_token) with these tiles, in place of the `down` grouped GEMM + sum_topk.
    down_by_token: GemmTiles | None = None
    # Up to FUSED_MAX_TOKENS tokens: the whole MLP in one kernel (fused_moe.fused_mlp) with these
    # tiles, in place of both GEMMs (and down_by_token).
    fused: FusedTiles | None = None

    def to_json(self) -> dict:
        d = {"block_m": self.block_m, "gate_up": list(self.gate_up), "down": list(self.down)}
        optional = {"down_by_token": self.down_by_token, "fused": self.fused}
        return d | {name: list(tiles) for name, tiles in optional.items() if tiles is not None}

    @staticmethod
    def from_json(d: dict) -> MoeConfig:
        by_token = GemmTiles(*d["down_by_token"]) if "down_by_token" in d else None
        fused = FusedTiles(*d["fused"]) if "fused" in d else None
        return MoeConfig(int(d["block_m"]), GemmTiles(*d["gate_up"]), GemmTiles(*d["down"]), by_token, fused)


def problem_key(num_experts: int, hidden: int, inter: int, kind: str) -> str:
    """`kind` is the weights' torch dtype name (bfloat16) or their quantized form (int4-g128, fp8-channel)."""
    return f"E={num_experts},H={hidden},I={inter},{kind}"


def device_key(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@functools.lru_cache(maxsize=1)
def load_table(path: str = TABLE_PATH) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def default_moe_config(num_slots: int, num_experts: int) -> MoeConfig:
    """By slots per expert. Up to 16 (decode) every expert's weights are read for a block or two of
    rows, so the smallest tensor-core BLOCK_M and long K tiles keep many loads in flight; with more
    rows per expert the GEMMs turn compute-bound and take larger tiles. Three stages fit the
    gate_up kernel's two weight tiles in shared memory of GPUs smaller than Hopper."""
    per_expert = num_slots / num_experts
    if per_expert <= 16:
        return MoeConfig(16, GemmTiles(64, 128, 4, 3), GemmTiles(64, 128, 4, 4))
    if per_expert <= 64:
        return MoeConfig(32, GemmTiles(64, 64, 4, 3), GemmTiles(64, 64, 4, 3))
    return MoeConfig(64, GemmTiles(64, 64, 4, 3), GemmTiles(128, 64, 8, 3))


def default_fused_tiles(top_k: int, inter: int) -> FusedTiles:
    """block_i for one token's k * I / block_i programs near 256, about two per SM of an H100/H200's
    132 (192 at Qwen3-30B-A3B, 224 at Mixtral), within 16 (tl.dot's minimum) and 128; 256-row chunks
    of H: 8 or 16 counters per token, each sum k * I / block_i rows of 1 KiB. Untuned: the starting
    point benchmarks/moe_kernel.py --fused times, whose best tiles go into the table's `fused` entry."""
    block_i = min(128, max(16, triton.next_power_of_2(top_k * inter // 256)))
    return FusedTiles(block_i, 128, 256, 4, 3)


def lookup(device: str, key: str, m: int, table: dict | None = None) -> MoeConfig | None:
    entries = (load_table() if table is None else table).get(device, {}).get(key)
    if not entries:
        return None
    sizes = sorted(int(s) for s in entries)
    size = next((s for s in sizes if s >= m), sizes[-1])
    return MoeConfig.from_json(entries[str(size)])


def fit_tiles(tiles: GemmTiles, n: int, k: int, group_size: int | None) -> GemmTiles:
    """Tiles no larger than the problem (rounded up to 16, the tl.dot minimum); a K tile inside one
    group when the group is a power of two, so a tile needs one scale per row."""
    return tiles._replace(
        block_n=min(tiles.block_n, max(16, triton.next_power_of_2(n))),
        block_k=_inside_group(min(tiles.block_k, max(16, triton.next_power_of_2(k))), k, group_size),
    )


def _inside_group(block: int, k: int, group_size: int | None) -> int:
    if group_size is not None and group_size < k and group_size >= 16 and group_size & (group_size - 1) == 0:
        return min(block, group_size)
    return block


def fit_fused_tiles(tiles: FusedTiles, hidden: int, inter: int, groups: tuple[int | None, int | None]) -> FusedTiles:
    """fit_tiles for the fused MLP: block_i is gate_up's N tile and down's K tile (inside one of
    w2's groups), block_k gate_up's K tile (inside one of w13's), block_h down's N tile."""
    gate_up = fit_tiles(GemmTiles(tiles.block_i, tiles.block_k, 0, 0), inter, hidden, groups[0])
    down = fit_tiles(GemmTiles(tiles.block_h, gate_up.block_n, 0, 0), hidden, inter, groups[1])
    return tiles._replace(block_i=down.block_k, block_k=gate_up.block_k, block_h=down.block_n)


def choose_moe_config(
    m: int,
    top_k: int,
    num_experts: int,
    hidden: int,
    inter: int,
    kind: str,
    device: torch.device,
    groups: tuple[int | None, int | None] = (None, None),
) -> MoeConfig:
    """The tuned entry for this GPU and problem, else the heuristic; fitted to the problem either way.
    `groups`: the gate_up and down weights' quantization group sizes (None for dense)."""
    cfg = lookup(device_key(device), problem_key(num_experts, hidden, inter, kind), m)
    if cfg is None:
        cfg = default_moe_config(m * top_k, num_experts)
    block_m = min(cfg.block_m, max(16, triton.next_power_of_2(m * top_k)))
    by_token = cfg.down_by_token if m == 1 else None  # an M = 1 entry may serve larger M beyond the table
    fused = cfg.fused if m <= FUSED_MAX_TOKENS else None  # only where measured faster: the table's entry
    return MoeConfig(
        block_m,
        fit_tiles(cfg.gate_up, inter, hidden, groups[0]),
        fit_tiles(cfg.down, hidden, inter, groups[1]),
        None if by_token is None else fit_tiles(by_token, hidden, inter, groups[1]),
        None if fused is None else fit_fused_tiles(fused, hidden, inter, groups),
    )
