"""Group the (token, expert) slots of a batch by expert, each expert's run padded to the GEMM's BLOCK_M.

The grouped GEMMs then give every BLOCK_M block of sorted slots one expert, so each program reads
one expert's weights and at large batch every expert's weights are read once per N tile. Slot
s = token * top_k + j stands for the j-th expert chosen by `token`.

No step reads a count back to the host: every buffer is sized for the worst case from M, k and E
alone (`max_padded_slots`), and the GEMMs stop at `num_tokens_post_padded`, which stays on the
GPU. So a CUDA graph captured for one batch size replays for any routing. Three kernels:
  1. per chunk of slots: a count per expert, and each slot's rank among its chunk's slots of the
     same expert (a cumulative sum over a one-hot [chunk, E] tile);
  2. one program: per expert, the slots of earlier chunks (turning the counts into offsets), the
     padded run lengths and their starts, the block -> expert map and the padded total;
  3. per chunk: each slot's place = its expert's start + the chunk's offset + its rank.
Places are thus in slot order within an expert: the layout is deterministic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

_TILE_ELEMENTS = 8192  # one-hot slots x experts per program


class MoeAlignment(NamedTuple):
    sorted_token_ids: torch.Tensor        # int32 [max_padded_slots]: slot ids grouped by expert; padding = M * k
    expert_ids: torch.Tensor              # int32 [max_padded_slots / block_m]: each block's expert; -1 past the end
    num_tokens_post_padded: torch.Tensor  # int32 [1]: the padded total, on the device
    block_m: int


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """At most min(slots, E) experts receive slots, each padding its run by at most block_m - 1;
    rounded up to whole blocks."""
    worst = num_slots + min(num_slots, num_experts) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, ranks_ptr, num_slots, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    chunk = tl.program_id(0)
    slots = chunk * CHUNK + tl.arange(0, CHUNK)
    experts = tl.arange(0, BLOCK_E)
    ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=BLOCK_E)  # padding matches no expert
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
    before_or_self = tl.cumsum(onehot, axis=0)
    tl.store(ranks_ptr + slots, tl.sum(before_or_self * onehot, axis=1) - 1, mask=slots < num_slots)
    tl.store(counts_ptr + chunk * E + experts, tl.sum(onehot, axis=0), mask=experts < E)


@triton.jit
def _offsets_kernel(counts_ptr, starts_ptr, expert_ids_ptr, total_ptr, num_chunks, E, num_blocks,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK_TILE: tl.constexpr,
                    BLOCK_TILE: tl.constexpr):
    experts = tl.arange(0, BLOCK_E)
    e_mask = experts < E
    running = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, num_chunks, CHUNK_TILE):
        chunks = c0 + tl.arange(0, CHUNK_TILE)
        ptrs = counts_ptr + chunks[:, None] * E + experts[None, :]
        mask = (chunks[:, None] < num_chunks) & e_mask[None, :]
        counts = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(counts, axis=0) - counts + running[None, :], mask=mask)
        running += tl.sum(counts, axis=0)
    padded = (running + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(starts_ptr + experts, ends - padded, mask=e_mask)
    total = tl.sum(padded, axis=0)
    tl.store(total_ptr, total)
    for b0 in range(0, num_blocks, BLOCK_TILE):
        blocks = b0 + tl.arange(0, BLOCK_TILE)
        first_slot = blocks * BLOCK_M
        # The expert whose run holds first_slot is the number of runs that end at or before it.
        expert = tl.sum(((ends[None, :] <= first_slot[:, None]) & e_mask[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blocks, tl.where(first_slot < total, expert, -1), mask=blocks < num_blocks)


@triton.jit
def _scatter_kernel(ids_ptr, ranks_ptr, offsets_ptr, starts_ptr, sorted_ptr, num_slots, E, CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    slots = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = slots < num_slots
    ids = tl.load(ids_ptr + slots, mask=mask, other=0)
    place = (tl.load(starts_ptr + ids, mask=mask, other=0) + tl.load(offsets_ptr + chunk * E + ids, mask=mask, other=0)
             + tl.load(ranks_ptr + slots, mask=mask, other=0))
    tl.store(sorted_ptr + place, slots, mask=mask)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """topk_ids int32 [M, k] (every id in 0..E-1) -> the slots grouped by expert, padded to block_m."""
    if topk_ids.dtype != torch.int32 or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be int32 [M, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    ids = topk_ids.contiguous().view(-1)
    num_slots, device = ids.numel(), ids.device
    padded = max_padded_slots(num_slots, num_experts, block_m)
    num_blocks = padded // block_m
    sorted_ids = torch.full((padded,), num_slots, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    chunk = max(16, min(1024, _TILE_ELEMENTS // block_e, triton.next_power_of_2(max(num_slots, 1))))
    num_chunks = triton.cdiv(num_slots, chunk)
    counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    ranks = torch.empty(num_slots, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    if num_slots:
        _count_kernel[(num_chunks,)](ids, counts, ranks, num_slots, num_experts, CHUNK=chunk, BLOCK_E=block_e)
    tile = max(16, _TILE_ELEMENTS // 2 // block_e)
    _offsets_kernel[(1,)](counts, starts, expert_ids, total, num_chunks, num_experts, num_blocks,
                          BLOCK_M=block_m, BLOCK_E=block_e, CHUNK_TILE=tile, BLOCK_TILE=tile)
    if num_slots:
        _scatter_kernel[(num_chunks,)](ids, ranks, counts, starts, sorted_ids, num_slots, num_experts, CHUNK=chunk)
    return MoeAlignment(sorted_ids, expert_ids, total, block_m)
