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
     padded run lengths and their starts, the block -> expert map, the padded total, and the
     padding sentinel written over the whole sorted buffer;
  3. per chunk: each slot's place = its expert's start + the chunk's offset + its rank.
When all slots fit one chunk (decode: up to 64 slots at E=128, 1024 at E=8) one program does all
three, since at that size each launch costs more than its work; `route_and_align` also puts the
routing (moe_routing) in front of it in the same program.
Places are in slot order within an expert: the layout is deterministic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ember.kernels.moe_routing import ROUTE_WARPS, moe_route, route_outputs, route_rows, route_tiles

_TILE_ELEMENTS = 8192  # one-hot slots x experts per program


class MoeAlignment(NamedTuple):
    sorted_token_ids: torch.Tensor  # int32 [max_padded_slots]: slot ids grouped by expert; padding = M * k
    expert_ids: torch.Tensor  # int32 [max_padded_slots / block_m]: each block's expert; -1 past the end
    num_tokens_post_padded: torch.Tensor  # int32 [1]: the padded total, on the device
    block_m: int


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """At most min(slots, E) experts receive slots, each padding its run by at most block_m - 1;
    rounded up to whole blocks."""
    worst = num_slots + min(num_slots, num_experts) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


@triton.jit
def _chunk_ranks(ids_ptr, chunk, num_slots, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """A chunk's slots, their one-hot [CHUNK, BLOCK_E] experts, and each slot's rank among the
    chunk's earlier slots of the same expert."""
    slots = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=BLOCK_E)  # padding matches no expert
    onehot = (ids[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)
    ranks = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    return slots, onehot, ranks


@triton.jit
def _write_layout(
    counts,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    E,
    num_slots,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TILE: tl.constexpr,
):
    """From the slots per expert: the padded total, each block's expert (-1 past the total), every
    place of the sorted ids set to the padding sentinel; returns each expert's first place."""
    e_mask = tl.arange(0, BLOCK_E) < E
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(total_ptr, total)
    for b0 in range(0, num_blocks, BLOCK_TILE):
        blocks = b0 + tl.arange(0, BLOCK_TILE)
        first_slot = blocks * BLOCK_M
        # The expert whose run holds first_slot is the number of runs that end at or before it.
        expert = tl.sum(((ends[None, :] <= first_slot[:, None]) & e_mask[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blocks, tl.where(first_slot < total, expert, -1), mask=blocks < num_blocks)
        places = first_slot[:, None] + tl.arange(0, BLOCK_M)[None, :]
        tl.store(
            sorted_ptr + places,
            tl.zeros([BLOCK_TILE, BLOCK_M], tl.int32) + num_slots,
            mask=(blocks < num_blocks)[:, None],
        )
    return ends - padded


@triton.jit
def _align_in_one_program(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    num_slots,
    E,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_TILE: tl.constexpr,
):
    """All three steps in one program when every slot fits one chunk (decode): one launch, not three."""
    slots, onehot, ranks = _chunk_ranks(ids_ptr, 0, num_slots, CHUNK, BLOCK_E)
    starts = _write_layout(
        tl.sum(onehot, axis=0),
        sorted_ptr,
        expert_ids_ptr,
        total_ptr,
        E,
        num_slots,
        num_blocks,
        BLOCK_M,
        BLOCK_E,
        BLOCK_TILE,
    )
    tl.debug_barrier()  # the sentinel fill above lands before the slots overwrite it
    place = tl.sum(onehot * starts[None, :], axis=1) + ranks
    tl.store(sorted_ptr + place, slots, mask=slots < num_slots)


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def _align_one_program_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    num_slots,
    E,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_TILE: tl.constexpr,
):
    _align_in_one_program(
        ids_ptr, sorted_ptr, expert_ids_ptr, total_ptr, num_slots, E, num_blocks, BLOCK_M, BLOCK_E, CHUNK, BLOCK_TILE
    )


@triton.jit(do_not_specialize=["M", "num_blocks"])
def _route_align_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    M,
    E,
    stride_lm,
    num_blocks,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_TILE: tl.constexpr,
):
    """moe_route's kernel for all M tokens, then the one-program alignment over the ids it stored."""
    route_rows(logits_ptr, weights_ptr, ids_ptr, 0, M, E, stride_lm, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K)
    tl.debug_barrier()  # every thread's ids are stored before any thread reads them back
    _align_in_one_program(
        ids_ptr, sorted_ptr, expert_ids_ptr, total_ptr, M * TOP_K, E, num_blocks, BLOCK_M, BLOCK_E, CHUNK, BLOCK_TILE
    )


@triton.jit(do_not_specialize=["num_slots"])
def _count_kernel(ids_ptr, counts_ptr, ranks_ptr, num_slots, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    chunk = tl.program_id(0)
    slots, onehot, ranks = _chunk_ranks(ids_ptr, chunk, num_slots, CHUNK, BLOCK_E)
    experts = tl.arange(0, BLOCK_E)
    tl.store(ranks_ptr + slots, ranks, mask=slots < num_slots)
    tl.store(counts_ptr + chunk * E + experts, tl.sum(onehot, axis=0), mask=experts < E)


@triton.jit(do_not_specialize=["num_slots", "num_chunks", "num_blocks"])
def _offsets_kernel(
    counts_ptr,
    starts_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    num_slots,
    num_chunks,
    E,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK_TILE: tl.constexpr,
    BLOCK_TILE: tl.constexpr,
):
    """Turns each chunk's counts into the slots of earlier chunks per expert, then the layout."""
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
    starts = _write_layout(
        running, sorted_ptr, expert_ids_ptr, total_ptr, E, num_slots, num_blocks, BLOCK_M, BLOCK_E, BLOCK_TILE
    )
    tl.store(starts_ptr + experts, starts, mask=e_mask)


@triton.jit(do_not_specialize=["num_slots"])
def _scatter_kernel(ids_ptr, ranks_ptr, offsets_ptr, starts_ptr, sorted_ptr, num_slots, E, CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    slots = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = slots < num_slots
    ids = tl.load(ids_ptr + slots, mask=mask, other=0)
    place = (
        tl.load(starts_ptr + ids, mask=mask, other=0)
        + tl.load(offsets_ptr + chunk * E + ids, mask=mask, other=0)
        + tl.load(ranks_ptr + slots, mask=mask, other=0)
    )
    tl.store(sorted_ptr + place, slots, mask=mask)


class _Layout(NamedTuple):
    """An alignment's output buffers and the tile sizes its kernels take for one problem size."""

    align: MoeAlignment
    num_blocks: int
    block_e: int
    chunk: int
    block_tile: int


def _layout(num_slots: int, num_experts: int, block_m: int, device: torch.device) -> _Layout:
    num_blocks = max_padded_slots(num_slots, num_experts, block_m) // block_m
    align = MoeAlignment(
        torch.empty(num_blocks * block_m, dtype=torch.int32, device=device),
        torch.empty(num_blocks, dtype=torch.int32, device=device),
        torch.empty(1, dtype=torch.int32, device=device),
        block_m,
    )
    block_e = triton.next_power_of_2(num_experts)
    block_tile = max(1, _TILE_ELEMENTS // 2 // max(block_e, block_m))
    return _Layout(align, num_blocks, block_e, _chunk(num_slots, num_experts), block_tile)


def _chunk(num_slots: int, num_experts: int) -> int:
    """Slots per chunk: a [chunk, E] one-hot tile per program; every slot fits one when num_slots <= chunk."""
    block_e = triton.next_power_of_2(num_experts)
    return max(16, min(1024, _TILE_ELEMENTS // block_e, triton.next_power_of_2(max(num_slots, 1))))


def route_and_align(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, MoeAlignment]:
    """moe_route then moe_align_block_size, with the same outputs; in one launch when the tokens fit
    one routing program and their slots one alignment chunk (decode: up to 8 tokens at E=128, k=8;
    512 at E=8, k=2), since at that size each launch costs more than its work: on an H200 at
    Qwen3-30B-A3B decode the two took 3.9 and 2.8 us a layer, 48 layers a step."""
    m, e = router_logits.shape
    tiles = route_tiles(m, e, top_k)
    if m == 0 or tiles.block_t < m or m * top_k > _chunk(m * top_k, e):
        weights, ids = moe_route(router_logits, top_k, renormalize)
        return weights, ids, moe_align_block_size(ids, e, block_m)
    weights, ids = route_outputs(router_logits, top_k)
    lay = _layout(m * top_k, e, block_m, router_logits.device)
    _route_align_kernel[(1,)](
        router_logits,
        weights,
        ids,
        *lay.align[:3],
        m,
        e,
        router_logits.stride(0),
        lay.num_blocks,
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_T=tiles.block_t,
        BLOCK_E=tiles.block_e,
        BLOCK_K=tiles.block_k,
        BLOCK_M=block_m,
        CHUNK=lay.chunk,
        BLOCK_TILE=lay.block_tile,
        num_warps=ROUTE_WARPS,
    )
    return weights, ids, lay.align


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """topk_ids int32 [M, k] (every id in 0..E-1) -> the slots grouped by expert, padded to block_m."""
    if topk_ids.dtype != torch.int32 or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be int32 [M, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    ids = topk_ids.contiguous().view(-1)
    num_slots, device = ids.numel(), ids.device
    lay = _layout(num_slots, num_experts, block_m, device)
    sorted_ids, expert_ids, total, _ = lay.align
    num_blocks, block_e, chunk = lay.num_blocks, lay.block_e, lay.chunk
    layout = {"BLOCK_M": block_m, "BLOCK_E": block_e, "BLOCK_TILE": lay.block_tile}
    if num_slots <= chunk:
        _align_one_program_kernel[(1,)](
            ids, sorted_ids, expert_ids, total, num_slots, num_experts, num_blocks, CHUNK=chunk, **layout
        )
        return lay.align
    num_chunks = triton.cdiv(num_slots, chunk)
    counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    ranks = torch.empty(num_slots, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    _count_kernel[(num_chunks,)](ids, counts, ranks, num_slots, num_experts, CHUNK=chunk, BLOCK_E=block_e)
    _offsets_kernel[(1,)](
        counts,
        starts,
        sorted_ids,
        expert_ids,
        total,
        num_slots,
        num_chunks,
        num_experts,
        num_blocks,
        CHUNK_TILE=max(1, _TILE_ELEMENTS // 2 // block_e),
        **layout,
    )
    _scatter_kernel[(num_chunks,)](ids, ranks, counts, starts, sorted_ids, num_slots, num_experts, CHUNK=chunk)
    return lay.align
