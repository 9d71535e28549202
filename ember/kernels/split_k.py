"""Split-K partial sums inside the GEMM kernel, shared by the packed int4/int8 and the fp8 GEMMs.

With split-K each program writes its fp32 partial product; the last program of an output tile to
finish (an atomic counter, reset by that program so CUDA graph replays find it zero) sums the
partials in split order: deterministic, and no second kernel. The fp8 GEMM first summed its partials
with `torch.sum` and a cast to bf16, two more kernels per linear layer: 380 of 3,380 us per decode
step of the 8B shape on the H200 (latency-llama-3.1-8b-fp8-cuda-2026-12-03.json).

`arrive` and `sum_parts` are the two halves of that epilogue; the fused MoE MLP (fused_moe.fused_mlp)
uses them with a counter per (token, chunk of H) in place of one per output tile.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_TILES = 1 << 18  # counters per device (1 MiB): M = 64 one-row programs over N = 262144


@functools.cache
def tile_counters(device: torch.device) -> torch.Tensor:
    """Split-K tile counters, zero between kernels (the last program of a tile resets its counter).
    Made on the first call, which runs before CUDA graph capture (the warm-up pass)."""
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


@triton.jit
def arrive(counters, splits, mask):
    """Call after storing this program's partials: True where this program is the last of the
    `splits` programs sharing a counter to get there (those see every partial; `counters` may be one
    pointer or a tensor of them, `mask` says which to count). The last program resets its counter."""
    tl.debug_barrier()  # every thread's partial is stored before the counter says so
    is_last = mask & (tl.atomic_add(counters, 1, mask=mask, sem="acq_rel") == splits - 1)
    tl.atomic_xchg(counters, 0, mask=is_last)
    return is_last


@triton.jit
def sum_parts(parts, splits, split_stride, mask):
    """The fp32 partials at parts + split * split_stride summed in split order: the same sum whichever
    program does it. L2 reads (.cg): other programs wrote them."""
    result = tl.load(parts, mask=mask, other=0.0, cache_modifier=".cg")
    for split in range(1, splits):
        result += tl.load(parts + split * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return result


@triton.jit
def sum_splits(result, part_ptr, count_ptr, offs_m, offs_n, out_mask, M, N):
    """Store this program's [BLOCK_M, BLOCK_N] fp32 partial (grid axis 2 is the split); returns the
    sum over all splits and True in the tile's last program to finish, which alone stores the output."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(2)
    parts = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(parts + pid_k.to(tl.int64) * M * N, result, mask=out_mask)
    is_last = arrive(count_ptr + pid_m * tl.num_programs(1) + pid_n, splits, pid_k < splits)
    if is_last:
        result = sum_parts(parts, splits, M * N, out_mask)
    return result, is_last
