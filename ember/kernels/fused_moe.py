"""Fused mixture-of-experts MLP: two grouped GEMMs over the slots sorted by expert, then a sum over k.

    act[s] = silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T)     one kernel, two accumulators
    y[s]   = topk_weights[s] * (act[s] @ w2[e].T)                  one kernel
    out[t] = sum_j y[t * k + j]                                    a fixed-order sum, no atomics

for each slot s = t * k + j routed to expert e = topk_ids[t, j]. `moe_align_block_size` gives every
BLOCK_M block of sorted slots one expert, so a program multiplies that expert's weight tile with
the block's rows: at batch 1 only the k chosen experts' weights are read, at large batch each
expert's weights once per N tile. Nothing is read back to the host, so CUDA graphs capture it.
At M = 1, where the tuned table says so, down_by_token does the last two lines in one kernel, one
program per N tile of H walking the token's k experts in order (one launch fewer a layer).

Up to FUSED_MAX_TOKENS tokens (decode), where the tuned table has a `fused` entry (measured faster than
the two GEMMs by benchmarks/moe_kernel.py --fused), fused_mlp does all three lines in one launch: a program
per (block of sorted slots, BLOCK_I slice of I) computes its slice of act from x and w13 (K = H),
rounds it as the two-kernel path stores it, and at once multiplies it by w2[e][:, slice], chunk by
chunk of H, into fp32 partials weighted by the routing weight, one row of H per (token, j, slice).
The last program to store a (token, chunk) (an atomic counter, ember/kernels/split_k.py) sums the
k * I / BLOCK_I partials in (j, slice) order and writes the output: deterministic, act never leaves
the SM, and a layer is route_and_align plus this one kernel. Each program still reads only its
block's expert, so the experts read are those of the two-kernel path.

Quantized experts (`QuantizedExperts`: int8, int4 with groups and zeros, fp8 per channel)
dequantize tile by tile inside the K loop, through the same `dequant_tile` as quant_matmul, then
multiply in the activations' dtype on tensor cores; the codes stay quantized in HBM, which is what
decode's bandwidth-bound GEMMs gain from. Under tensor parallelism each rank passes its slice of
the intermediate dimension and gets a partial sum to all-reduce.

Arguments that follow the batch size (slot and block counts) are not specialized on, so one
compiled kernel serves every batch size: CUDA-graph capture at many sizes compiles nothing new.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ember.kernels.moe_align import MoeAlignment, moe_align_block_size, route_and_align
from ember.kernels.moe_config import FusedTiles, GemmTiles, MoeConfig, choose_moe_config
from ember.kernels.paged import dot_dtype, dot_precision, int4_k_tile
from ember.kernels.quant_matmul import dequant_tile
from ember.kernels.split_k import MAX_TILES, arrive, sum_parts, tile_counters
from ember.quant.experts import QuantizedExperts, dequantize_experts
from ember.quant.formats import KINDS

Experts = torch.Tensor | QuantizedExperts
_GROUP_M = 8  # M blocks that run side by side over the same N tile, sharing it in L2 at large batch
_SUM_BLOCK = 1024


@triton.jit
def _tile_coords(num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """Program -> (M block, N tile), GROUP_M M blocks at a time walking the N tiles together."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_n_blocks
    first_m = pid // per_group * GROUP_M
    group_m = tl.minimum(num_m_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _weight_tile(
    w_ptr,
    s_ptr,
    z_ptr,
    offs_n,
    n_mask,
    k0,
    K,
    num_groups,
    stride_wn,
    stride_sn,
    stride_zn,
    QUANT: tl.constexpr,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    UNIFORM_GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One expert's weight rows offs_n, columns [k0, k0 + BLOCK_K), as [BLOCK_N, BLOCK_K]."""
    if QUANT:
        w = dequant_tile(
            w_ptr,
            s_ptr,
            z_ptr,
            offs_n,
            n_mask,
            k0,
            K,
            num_groups,
            stride_wn,
            stride_sn,
            stride_zn,
            GROUP,
            INT4,
            HAS_ZEROS,
            UNIFORM_GROUP,
            BLOCK_K,
        )
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
            mask=n_mask[:, None] & (offs_k[None, :] < K),
            other=0.0,
        )
    return w


@triton.jit
def _products(
    x_rows,
    m_mask,
    w_ptr,
    s_ptr,
    z_ptr,
    offs_n,
    n_mask,
    N,
    K,
    num_groups,
    stride_wn,
    stride_sn,
    stride_zn,
    GATED: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    UNIFORM_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] products of the x rows with one expert's weight rows offs_n, and
    (GATED) with rows N + offs_n, the up half: both halves share each x tile's load."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0).to(DOT_DTYPE)
        w = _weight_tile(
            w_ptr,
            s_ptr,
            z_ptr,
            offs_n,
            n_mask,
            k0,
            K,
            num_groups,
            stride_wn,
            stride_sn,
            stride_zn,
            QUANT,
            GROUP,
            INT4,
            HAS_ZEROS,
            UNIFORM_GROUP,
            BLOCK_K,
        )
        acc = tl.dot(x, tl.trans(w.to(DOT_DTYPE)), acc, input_precision=PRECISION)
        if GATED:
            w_up = _weight_tile(
                w_ptr,
                s_ptr,
                z_ptr,
                offs_n + N,
                n_mask,
                k0,
                K,
                num_groups,
                stride_wn,
                stride_sn,
                stride_zn,
                QUANT,
                GROUP,
                INT4,
                HAS_ZEROS,
                UNIFORM_GROUP,
                BLOCK_K,
            )
            acc_up = tl.dot(x, tl.trans(w_up.to(DOT_DTYPE)), acc_up, input_precision=PRECISION)
    return acc, acc_up


@triton.jit
def _gate(acc, acc_up, bias_row, offs_n, n_mask, N, alpha, limit, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
    """silu(gate) * up of the gate and up products (after the expert's bias row, gate's then up's),
    or with SWIGLU gpt-oss's (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    if HAS_BIAS:
        acc += tl.load(bias_row + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias_row + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        gate = tl.minimum(acc, limit)
        return (tl.minimum(tl.maximum(acc_up, -limit), limit) + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    return acc / (1.0 + tl.exp(-acc)) * acc_up


@triton.jit(do_not_specialize=["num_slots", "num_m_blocks"])
def _grouped_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    route_w_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    bias_ptr,
    num_slots,
    N,
    K,
    num_groups,
    num_m_blocks,
    alpha,
    limit,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    stride_om,
    stride_be,
    SLOTS_PER_ROW: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    UNIFORM_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[s, n] for one block of sorted slots and one N tile. x row of slot s: s // SLOTS_PER_ROW
    (top_k for gate_up, whose x is the tokens' hidden states; 1 for down). GATED: weight rows n and
    N + n are gate and up, out = _gate(gate, up); else out = topk_weight[s] * (x @ w.T).
    HAS_BIAS adds the expert's bias row (gate's then up's, or down's) to the products first. It and
    SWIGLU are constexpr: without them the kernel is the one compiled before them."""
    pid_m, pid_n = _tile_coords(num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = slots < num_slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc, acc_up = _products(
        x_ptr + (slots // SLOTS_PER_ROW).to(tl.int64)[:, None] * stride_xm,
        m_mask,
        w_ptr + expert * stride_we,
        s_ptr + expert * stride_se,
        z_ptr + expert * stride_ze,
        offs_n,
        n_mask,
        N,
        K,
        num_groups,
        stride_wn,
        stride_sn,
        stride_zn,
        GATED,
        QUANT,
        GROUP,
        INT4,
        HAS_ZEROS,
        UNIFORM_GROUP,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        DOT_DTYPE,
        PRECISION,
    )
    if GATED:
        acc = _gate(acc, acc_up, bias_ptr + expert * stride_be, offs_n, n_mask, N, alpha, limit, HAS_BIAS, SWIGLU)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc = acc * tl.load(route_w_ptr + slots, mask=m_mask, other=0.0)[:, None]
    out = out_ptr + slots.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_topk_kernel(y_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = y[t * k] + ... + y[t * k + k - 1] in fp32, in that order, rounded once."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down_by_token_kernel(
    act_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    route_w_ptr,
    ids_ptr,
    bias_ptr,
    N,
    K,
    num_groups,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    stride_om,
    stride_be,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    UNIFORM_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[t, n tile] = sum_j topk_weight[t, j] * (act[t*k + j] @ w2[e_j].T + bias[e_j]) for one
    token t: the down GEMM and the sum over k in one program, so no atomics and a fixed order.
    One flat loop over (j, K tile) keeps the pipeline full across experts; fp32 products, no tl.dot
    (one row), so BLOCK_N may be under 16."""
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for it in range(0, TOP_K * k_tiles):
        slot = token * TOP_K + it // k_tiles
        k0 = it % k_tiles * BLOCK_K
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + slot * stride_am + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        w = _weight_tile(
            w_ptr + expert * stride_we,
            s_ptr + expert * stride_se,
            z_ptr + expert * stride_ze,
            offs_n,
            n_mask,
            k0,
            K,
            num_groups,
            stride_wn,
            stride_sn,
            stride_zn,
            QUANT,
            GROUP,
            INT4,
            HAS_ZEROS,
            UNIFORM_GROUP,
            BLOCK_K,
        )
        acc += w.to(tl.float32) * (a * tl.load(route_w_ptr + slot))[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        for j in tl.static_range(TOP_K):
            expert = tl.load(ids_ptr + token * TOP_K + j).to(tl.int64)
            bias = tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            out += tl.load(route_w_ptr + token * TOP_K + j) * bias
    tl.store(out_ptr + token * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit(do_not_specialize=["num_slots"])
def _mlp_kernel(
    x_ptr,
    w13_ptr,
    s13_ptr,
    z13_ptr,
    w2_ptr,
    s2_ptr,
    z2_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    route_w_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    b13_ptr,
    b2_ptr,
    num_slots,
    H,
    I,
    groups13,
    groups2,
    alpha,
    limit,
    stride_xm,
    stride_w13e,
    stride_w13n,
    stride_s13e,
    stride_s13n,
    stride_z13e,
    stride_z13n,
    stride_w2e,
    stride_w2n,
    stride_s2e,
    stride_s2n,
    stride_z2e,
    stride_z2n,
    stride_om,
    stride_b13e,
    stride_b2e,
    TOP_K: tl.constexpr,
    HAS_B13: tl.constexpr,
    HAS_B2: tl.constexpr,
    SWIGLU: tl.constexpr,
    QUANT13: tl.constexpr,
    GROUP13: tl.constexpr,
    INT4_13: tl.constexpr,
    ZEROS13: tl.constexpr,
    UNIFORM13: tl.constexpr,
    QUANT2: tl.constexpr,
    GROUP2: tl.constexpr,
    INT4_2: tl.constexpr,
    ZEROS2: tl.constexpr,
    UNIFORM2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The whole MLP of one block of sorted slots (one expert) for one BLOCK_I slice p of I:
    act = _gate(x @ w13[e, slice].T, x @ w13[e, I + slice].T), rounded to x's dtype, then per BLOCK_H
    chunk of H the partial topk_weight * (act @ w2[e, chunk, slice].T) of each slot's token, stored
    as split j * (I / BLOCK_I) + p of that token (j: the slot's place in the token's top k). The last
    program to store a (token, chunk) sums its k * I / BLOCK_I splits in split order and writes the
    output. Programs start their chunk walk at different chunks, so the last arrivals (and the sums)
    spread over the programs finishing last rather than all falling to one."""
    pid_m, pid_i = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = slots < num_slots
    tokens = (slots // TOP_K).to(tl.int64)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    gate, up = _products(
        x_ptr + tokens[:, None] * stride_xm,
        m_mask,
        w13_ptr + expert * stride_w13e,
        s13_ptr + expert * stride_s13e,
        z13_ptr + expert * stride_z13e,
        offs_i,
        offs_i < I,
        I,
        H,
        groups13,
        stride_w13n,
        stride_s13n,
        stride_z13n,
        True,
        QUANT13,
        GROUP13,
        INT4_13,
        ZEROS13,
        UNIFORM13,
        BLOCK_M,
        BLOCK_I,
        BLOCK_K,
        DOT_DTYPE,
        PRECISION,
    )
    act = _gate(gate, up, b13_ptr + expert * stride_b13e, offs_i, offs_i < I, I, alpha, limit, HAS_B13, SWIGLU)
    act = act.to(out_ptr.dtype.element_ty).to(DOT_DTYPE)
    route_w = tl.load(route_w_ptr + slots, mask=m_mask, other=0.0)
    splits = TOP_K * tl.num_programs(1)
    parts = part_ptr + (tokens * splits)[:, None] * H
    mine = parts + ((slots % TOP_K) * tl.num_programs(1) + pid_i).to(tl.int64)[:, None] * H
    num_chunks = tl.cdiv(H, BLOCK_H)
    for it in range(0, num_chunks):
        chunk = (it + pid_m + pid_i) % num_chunks
        offs_h = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = offs_h < H
        w = _weight_tile(
            w2_ptr + expert * stride_w2e,
            s2_ptr + expert * stride_s2e,
            z2_ptr + expert * stride_z2e,
            offs_h,
            h_mask,
            pid_i * BLOCK_I,
            I,
            groups2,
            stride_w2n,
            stride_s2n,
            stride_z2n,
            QUANT2,
            GROUP2,
            INT4_2,
            ZEROS2,
            UNIFORM2,
            BLOCK_I,
        )
        y = tl.dot(act, tl.trans(w.to(DOT_DTYPE)), input_precision=PRECISION)
        if HAS_B2:
            if pid_i == 0:  # the expert's bias once per slot, in its first slice's split
                y += tl.load(b2_ptr + expert * stride_b2e + offs_h, mask=h_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(mine + offs_h[None, :], y * route_w[:, None], mask=m_mask[:, None] & h_mask[None, :])
        is_last = arrive(count_ptr + tokens * num_chunks + chunk, splits, m_mask)
        if tl.max(is_last.to(tl.int32), axis=0) > 0:
            mask = is_last[:, None] & h_mask[None, :]
            out = sum_parts(parts + offs_h[None, :], splits, H, mask)
            tl.store(
                out_ptr + tokens[:, None] * stride_om + offs_h[None, :], out.to(out_ptr.dtype.element_ty), mask=mask
            )


class _Operand(NamedTuple):
    """An expert weight as the GEMM kernel takes it: codes or values, scales, zeros and their strides."""

    w: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    quant: bool
    group: int
    int4: bool
    has_zeros: bool
    num_groups: int


def _operand(w: Experts) -> _Operand:
    if isinstance(w, QuantizedExperts):
        zeros = w.zeros if w.zeros is not None else w.scales
        return _Operand(
            w.qweight, w.scales, zeros, True, w.group_size, w.kind == "int4", w.zeros is not None, w.scales.shape[2]
        )
    return _Operand(w, w, w, False, 1, False, False, 1)


def weight_kind(w: Experts) -> str:
    """The config table's name for a weight's storage: dtype, or quantized kind and group size."""
    if isinstance(w, QuantizedExperts):
        return f"{w.kind}-{'channel' if w.group_size >= w.in_features else f'g{w.group_size}'}"
    return str(w.dtype).removeprefix("torch.")


def _shape(w: Experts) -> tuple[int, int, int]:
    if isinstance(w, QuantizedExperts):
        if w.kind not in KINDS:
            raise ValueError(f"fused_moe takes {', '.join(KINDS)} experts, not {w.kind}")
        parts = [w.qweight, w.scales] + ([w.zeros] if w.zeros is not None else [])
        if any(t.stride(2) != 1 for t in parts):
            raise ValueError("quantized experts need a contiguous last dimension")
        return w.num_experts, w.out_features, w.in_features
    if w.dim() != 3 or w.stride(2) != 1:
        raise ValueError(f"dense experts must be [E, N, K] with a contiguous last dim, got {tuple(w.shape)}")
    return w.shape[0], w.shape[1], w.shape[2]


def _check(
    hidden: torch.Tensor, w13: Experts, w2: Experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> tuple[int, int]:
    """(E, I) after checking every shape against hidden [M, H]."""
    if hidden.dim() != 2 or hidden.stride(1) != 1:
        raise ValueError(f"hidden must be [M, H] with a contiguous last dim, got {tuple(hidden.shape)}")
    m, h = hidden.shape
    e, two_i, h13 = _shape(w13)
    e2, h2, inter = _shape(w2)
    if two_i % 2 or h13 != h or (e2, h2, inter) != (e, h, two_i // 2):
        raise ValueError(
            f"w13 [E, 2I, H] and w2 [E, H, I] disagree with each other or with hidden [M, {h}]: "
            f"w13 {(e, two_i, h13)}, w2 {(e2, h2, inter)}"
        )
    if topk_ids.dtype != torch.int32 or topk_ids.dim() != 2 or topk_ids.shape[0] != m:
        raise ValueError(f"topk_ids must be int32 [{m}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights must be float32 {tuple(topk_ids.shape)}, got "
            f"{topk_weights.dtype} {tuple(topk_weights.shape)}"
        )
    return e, inter


def grouped_gemm(
    x: torch.Tensor,
    w: Experts,
    out: torch.Tensor,
    align: MoeAlignment,
    tiles: GemmTiles,
    slots_per_row: int,
    route_weights: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
) -> None:
    """out[s] for every sorted slot s: silu-and-mul (or `swiglu`) of the gate and up halves of w
    (route_weights None), else route_weights[s] times the product; `bias` [E, N] joins the product."""
    op = _operand(w)
    tiles = tiles._replace(block_k=int4_k_tile(tiles.block_k, op.int4, x.dtype))
    alpha, limit = swiglu or (0.0, 0.0)
    gated = route_weights is None
    n = out.shape[1]
    k = x.shape[1]
    num_slots = out.shape[0]
    num_m_blocks = align.expert_ids.numel()
    grid = (num_m_blocks * triton.cdiv(n, tiles.block_n),)
    _grouped_gemm_kernel[grid](
        x,
        op.w,
        op.scales,
        op.zeros,
        out,
        out if gated else route_weights,
        align.sorted_token_ids,
        align.expert_ids,
        align.num_tokens_post_padded,
        out if bias is None else bias,
        num_slots,
        n,
        k,
        op.num_groups,
        num_m_blocks,
        alpha,
        limit,
        x.stride(0),
        op.w.stride(0),
        op.w.stride(1),
        op.scales.stride(0),
        op.scales.stride(1),
        op.zeros.stride(0),
        op.zeros.stride(1),
        out.stride(0),
        0 if bias is None else bias.stride(0),
        SLOTS_PER_ROW=slots_per_row,
        GATED=gated,
        HAS_BIAS=bias is not None,
        SWIGLU=swiglu is not None,
        QUANT=op.quant,
        GROUP=op.group,
        INT4=op.int4,
        HAS_ZEROS=op.has_zeros,
        UNIFORM_GROUP=op.group % tiles.block_k == 0 or op.group >= k,
        BLOCK_M=align.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        GROUP_M=_GROUP_M,
        DOT_DTYPE=dot_dtype(x.dtype),
        PRECISION=dot_precision(x.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def down_by_token(
    act: torch.Tensor,
    w2: Experts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: GemmTiles,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """act [M * k, I] -> [M, H]: the down GEMM with each token's weighted sum over its k experts,
    one program per (token, N tile); replaces grouped_gemm + sum_topk at M = 1 where the config says
    so and has no fused tiles (every expert is read once either way, and the sum's launch, 1.6 us a
    layer at Qwen3-30B-A3B decode on an H200, goes)."""
    op = _operand(w2)
    m, top_k = topk_ids.shape
    n, k = _shape(w2)[1], act.shape[1]
    out = torch.empty(m, n, dtype=act.dtype, device=act.device)
    _down_by_token_kernel[(m, triton.cdiv(n, tiles.block_n))](
        act,
        op.w,
        op.scales,
        op.zeros,
        out,
        topk_weights.contiguous(),
        topk_ids.contiguous(),
        out if bias is None else bias,
        n,
        k,
        op.num_groups,
        act.stride(0),
        op.w.stride(0),
        op.w.stride(1),
        op.scales.stride(0),
        op.scales.stride(1),
        op.zeros.stride(0),
        op.zeros.stride(1),
        out.stride(0),
        0 if bias is None else bias.stride(0),
        TOP_K=top_k,
        HAS_BIAS=bias is not None,
        QUANT=op.quant,
        GROUP=op.group,
        INT4=op.int4,
        HAS_ZEROS=op.has_zeros,
        UNIFORM_GROUP=op.group % tiles.block_k == 0 or op.group >= k,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def fused_mlp(
    hidden: torch.Tensor,
    w13: Experts,
    w2: Experts,
    topk_weights: torch.Tensor,
    align: MoeAlignment,
    tiles: FusedTiles,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
) -> torch.Tensor:
    """The whole experts MLP, gate/up, activation, down and the sum over k, in one launch (_mlp_kernel);
    for a few tokens (moe_config's
    FUSED_MAX_TOKENS), where the two GEMM launches and the act round trip between them cost more than
    the fp32 partials it writes (k * I / block_n rows of H per token, summed in L2)."""
    m, h = hidden.shape
    top_k = topk_weights.shape[1]
    inter = _shape(w2)[2]
    op13, op2 = _operand(w13), _operand(w2)
    # block_i is the down product's K tile
    tiles = tiles._replace(
        block_k=int4_k_tile(tiles.block_k, op13.int4, hidden.dtype),
        block_i=int4_k_tile(tiles.block_i, op2.int4, hidden.dtype),
    )
    slices, chunks = triton.cdiv(inter, tiles.block_i), triton.cdiv(h, tiles.block_h)
    if m * chunks > MAX_TILES:
        raise ValueError(f"fused_mlp: {m} tokens x {chunks} chunks of H need more than {MAX_TILES} counters")
    out = torch.empty_like(hidden)
    part = torch.empty(m, top_k * slices, h, dtype=torch.float32, device=hidden.device)
    alpha, limit = swiglu or (0.0, 0.0)
    _mlp_kernel[(align.expert_ids.numel(), slices)](
        hidden,
        op13.w,
        op13.scales,
        op13.zeros,
        op2.w,
        op2.scales,
        op2.zeros,
        out,
        part,
        tile_counters(hidden.device),
        topk_weights.contiguous(),
        align.sorted_token_ids,
        align.expert_ids,
        align.num_tokens_post_padded,
        out if b13 is None else b13,
        out if b2 is None else b2,
        m * top_k,
        h,
        inter,
        op13.num_groups,
        op2.num_groups,
        alpha,
        limit,
        hidden.stride(0),
        op13.w.stride(0),
        op13.w.stride(1),
        op13.scales.stride(0),
        op13.scales.stride(1),
        op13.zeros.stride(0),
        op13.zeros.stride(1),
        op2.w.stride(0),
        op2.w.stride(1),
        op2.scales.stride(0),
        op2.scales.stride(1),
        op2.zeros.stride(0),
        op2.zeros.stride(1),
        out.stride(0),
        0 if b13 is None else b13.stride(0),
        0 if b2 is None else b2.stride(0),
        TOP_K=top_k,
        HAS_B13=b13 is not None,
        HAS_B2=b2 is not None,
        SWIGLU=swiglu is not None,
        QUANT13=op13.quant,
        GROUP13=op13.group,
        INT4_13=op13.int4,
        ZEROS13=op13.has_zeros,
        UNIFORM13=op13.group % tiles.block_k == 0 or op13.group >= h,
        QUANT2=op2.quant,
        GROUP2=op2.group,
        INT4_2=op2.int4,
        ZEROS2=op2.has_zeros,
        UNIFORM2=op2.group % tiles.block_i == 0 or op2.group >= inter,
        BLOCK_M=align.block_m,
        BLOCK_I=tiles.block_i,
        BLOCK_K=tiles.block_k,
        BLOCK_H=tiles.block_h,
        DOT_DTYPE=dot_dtype(hidden.dtype),
        PRECISION=dot_precision(hidden.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def sum_topk(y: torch.Tensor, top_k: int) -> torch.Tensor:
    """y [M * k, H] -> [M, H], summing each token's k rows."""
    m, h = y.shape[0] // top_k, y.shape[1]
    if top_k == 1:
        return y
    out = torch.empty(m, h, dtype=y.dtype, device=y.device)
    block = min(_SUM_BLOCK, triton.next_power_of_2(h))
    _sum_topk_kernel[(m, triton.cdiv(h, block))](y, out, h, TOP_K=top_k, BLOCK=block, num_warps=4)
    return out


def moe_config_for(hidden: torch.Tensor, w13: Experts, w2: Experts, top_k: int) -> MoeConfig:
    e, two_i, h = _shape(w13)
    g13, g2 = (w.group_size if isinstance(w, QuantizedExperts) else None for w in (w13, w2))
    return choose_moe_config(hidden.shape[0], top_k, e, h, two_i // 2, weight_kind(w13), hidden.device, (g13, g2))


def fused_moe(
    hidden: torch.Tensor,
    w13: Experts,
    w2: Experts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeConfig | None = None,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) -> [M, H] in hidden's dtype.

    w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]: dense or QuantizedExperts. `config`
    overrides the tuned table (for tuning and tests). The intermediate activations are rounded to
    hidden's dtype, as the dense MLP rounds them; each token's k results are summed in fp32.
    gpt-oss: biases b13 [E, 2I] and b2 [E, H] (added before the routing weight), and `swiglu` =
    (alpha, limit) for its clamped SwiGLU in place of silu(gate) * up."""
    e, inter = _check(hidden, w13, w2, topk_weights, topk_ids)
    _check_biases(b13, b2, e, inter, hidden.shape[1])
    if hidden.shape[0] == 0:
        return torch.empty_like(hidden)
    cfg = config or moe_config_for(hidden, w13, w2, topk_ids.shape[1])
    align = moe_align_block_size(topk_ids, e, cfg.block_m)
    return _experts_mlp(hidden, w13, w2, topk_weights, topk_ids, align, cfg, b13, b2, swiglu)


def fused_moe_from_logits(
    hidden: torch.Tensor,
    w13: Experts,
    w2: Experts,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    config: MoeConfig | None = None,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
) -> torch.Tensor:
    """fused_moe of moe_route(router_logits, top_k, renormalize): the same result, with the routing
    and the alignment in one launch at decode sizes (route_and_align)."""
    if hidden.shape[0] == 0:
        return torch.empty_like(hidden)
    cfg = config or moe_config_for(hidden, w13, w2, top_k)
    weights, ids, align = route_and_align(router_logits, top_k, renormalize, cfg.block_m)
    e, inter = _check(hidden, w13, w2, weights, ids)
    _check_biases(b13, b2, e, inter, hidden.shape[1])
    return _experts_mlp(hidden, w13, w2, weights, ids, align, cfg, b13, b2, swiglu)


def _experts_mlp(
    hidden: torch.Tensor,
    w13: Experts,
    w2: Experts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    align: MoeAlignment,
    cfg: MoeConfig,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    swiglu: tuple[float, float] | None,
) -> torch.Tensor:
    """Where the config has fused tiles (up to FUSED_MAX_TOKENS tokens, a tuned entry) the whole MLP in one
    kernel (fused_mlp). Else the gate_up grouped GEMM over the aligned slots, then down and each token's
    sum over its k experts: one kernel (down_by_token) where the config says so, else a grouped GEMM and
    sum_topk."""
    if cfg.fused is not None:
        return fused_mlp(hidden, w13, w2, topk_weights, align, cfg.fused, b13, b2, swiglu)
    m, h = hidden.shape
    top_k = topk_ids.shape[1]
    inter = _shape(w2)[2]
    act = torch.empty(m * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    grouped_gemm(hidden, w13, act, align, cfg.gate_up, top_k, bias=b13, swiglu=swiglu)
    if cfg.down_by_token is not None:
        return down_by_token(act, w2, topk_weights, topk_ids, cfg.down_by_token, b2)
    y = torch.empty(m * top_k, h, dtype=hidden.dtype, device=hidden.device)
    grouped_gemm(act, w2, y, align, cfg.down, 1, topk_weights.contiguous().view(-1), bias=b2)
    return sum_topk(y, top_k)


def _check_biases(b13: torch.Tensor | None, b2: torch.Tensor | None, e: int, inter: int, h: int) -> None:
    for name, b, shape in (("b13", b13, (e, 2 * inter)), ("b2", b2, (e, h))):
        if b is not None and (tuple(b.shape) != shape or b.stride(1) != 1):
            raise ValueError(f"{name} must be {shape} with a contiguous last dim, got {tuple(b.shape)}")


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: Experts,
    w2: Experts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
) -> torch.Tensor:
    """The same MoE in float64 torch, one expert at a time over the tokens routed to it."""
    dense13 = (dequantize_experts(w13) if isinstance(w13, QuantizedExperts) else w13).double()
    dense2 = (dequantize_experts(w2) if isinstance(w2, QuantizedExperts) else w2).double()
    x = hidden.double()
    out = torch.zeros_like(x)
    for e in range(dense13.shape[0]):
        tokens, j = (topk_ids == e).nonzero(as_tuple=True)
        gate_up = x[tokens] @ dense13[e].T + (0.0 if b13 is None else b13[e].double())
        gate, up = gate_up.chunk(2, dim=-1)
        if swiglu is None:
            act = torch.nn.functional.silu(gate) * up
        else:
            alpha, limit = swiglu
            gate = gate.clamp(max=limit)
            act = (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)
        y = act @ dense2[e].T + (0.0 if b2 is None else b2[e].double())
        out.index_add_(0, tokens, y * topk_weights[tokens, j, None].double())
    return out.to(hidden.dtype)
