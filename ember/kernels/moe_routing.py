"""Mixture-of-experts routing: softmax over all experts, top-k, optional renormalisation, in one kernel.

Decode runs this once per layer on a handful of rows, so its cost is launch latency: one kernel
rather than torch's softmax + topk + sum + divide (four launches, two of them reductions). Each
program takes BLOCK_T tokens; the top k are found by k rounds of argmax with the taken expert
masked out, so ties go to the lower expert index (as a stable descending sort orders them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

_TILE_ELEMENTS = 4096  # tokens x experts per program: a [BLOCK_T, E] tile held in registers
ROUTE_WARPS = 4


@triton.jit
def route_rows(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    first_row,
    M,
    E,
    stride_lm,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Routes tokens first_row .. first_row + BLOCK_T - 1 (those below M) into weights and ids
    [M, k]. Also the first half of moe_align's one-launch route_and_align."""
    rows = first_row + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < M
    logits = tl.load(
        logits_ptr + rows[:, None].to(tl.int64) * stride_lm + cols[None, :],
        mask=row_mask[:, None] & (cols[None, :] < E),
        other=float("-inf"),
    ).to(tl.float32)
    # Padding rows are all -inf; shifting them by 0 and dividing by 1 keeps their (unused) softmax finite.
    row_max = tl.where(row_mask, tl.max(logits, axis=1), 0.0)
    p = tl.exp(logits - row_max[:, None])
    p = p / tl.where(row_mask, tl.sum(p, axis=1), 1.0)[:, None]
    p = tl.where(cols[None, :] < E, p, -2.0)  # never taken, even where softmax underflows to 0
    kcols = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(p, axis=1, tie_break_left=True)
        weights = tl.where(kcols[None, :] == j, tl.max(p, axis=1)[:, None], weights)
        ids = tl.where(kcols[None, :] == j, best[:, None].to(tl.int32), ids)
        p = tl.where(cols[None, :] == best[:, None], -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.where(row_mask, tl.sum(weights, axis=1), 1.0)[:, None]
    out = rows[:, None].to(tl.int64) * TOP_K + kcols[None, :]
    out_mask = row_mask[:, None] & (kcols[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights, mask=out_mask)
    tl.store(ids_ptr + out, ids, mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _moe_route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    M,
    E,
    stride_lm,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    first_row = tl.program_id(0) * BLOCK_T
    route_rows(
        logits_ptr, weights_ptr, ids_ptr, first_row, M, E, stride_lm, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K
    )


class RouteTiles(NamedTuple):
    block_t: int  # tokens per program
    block_e: int
    block_k: int


def route_tiles(m: int, num_experts: int, top_k: int) -> RouteTiles:
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(triton.next_power_of_2(m), _TILE_ELEMENTS // block_e))
    return RouteTiles(block_t, block_e, triton.next_power_of_2(top_k))


def route_outputs(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (weights float32 [M, k], ids int32 [M, k]) after checking the arguments."""
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(f"router_logits must be [M, E] with a contiguous last dim, got {tuple(router_logits.shape)}")
    m, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in 1..{e} (the number of experts), got {top_k}")
    weights = torch.empty(m, top_k, dtype=torch.float32, device=router_logits.device)
    return weights, torch.empty(m, top_k, dtype=torch.int32, device=router_logits.device)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [M, E] -> (topk_weights float32 [M, k], topk_ids int32 [M, k]), best first.

    The weights are softmax probabilities over all E experts, divided by their sum over the k chosen
    when `renormalize` (Qwen3-MoE's norm_topk_prob, Mixtral)."""
    weights, ids = route_outputs(router_logits, top_k)
    m, e = router_logits.shape
    if m == 0:
        return weights, ids
    tiles = route_tiles(m, e, top_k)
    _moe_route_kernel[(triton.cdiv(m, tiles.block_t),)](
        router_logits,
        weights,
        ids,
        m,
        e,
        router_logits.stride(0),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_T=tiles.block_t,
        BLOCK_E=tiles.block_e,
        BLOCK_K=tiles.block_k,
        num_warps=ROUTE_WARPS,
    )
    return weights, ids


def moe_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
