"""Split-K partial sums inside the GEMM kernel, shared by the packed int4/int8 and the fp8 GEMMs.

With split-K each program writes its fp32 partial product; the last program of an output tile to
finish (an atomic counter, reset by that program so CUDA graph replays find it zero) sums the
partials in split order: deterministic, and no second kernel. The fp8 GEMM first summed its partials
with `torch.sum` and a cast to bf16, two more kernels per linear layer: 380 of 3,380 us per decode
step of the 8B shape on the H200 (latency-llama-3.1-8b-fp8-cuda-2026-12-03.json).
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
def sum_splits(result, part_ptr, count_ptr, offs_m, offs_n, out_mask, M, N):
    """Store this program's [BLOCK_M, BLOCK_N] fp32 partial (grid axis 2 is the split); returns the
    sum over all splits and True in the tile's last program to finish, which alone stores the output."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(2)
    parts = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(parts + pid_k.to(tl.int64) * M * N, result, mask=out_mask)
    tl.debug_barrier()  # every thread's partial is stored before the counter says so
    counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
    is_last = tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1
    if is_last:
        result = tl.zeros_like(result)
        for split in range(splits):
            result += tl.load(parts + split * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0)
    return result, is_last
