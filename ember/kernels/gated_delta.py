"""The gated delta rule (Qwen3-Next's linear attention) over the state pool: a step's prompt chunks, or its
decodes as one-token sequences (`prefill_gated_delta`), in one launch that reads and writes each
sequence's recurrent state in place in the pool.

One program per (sequence, value head, block of value channels): it L2-normalises its key head's q and k
(float32, eps 1e-6, transformers' l2norm), scales q by 1/sqrt(k_dim), loads its [k_dim, BLOCK_V] tile of
the state (zeros for a sequence with no context yet), and computes

    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q

then stores the tile back. Value heads share a key head in groups of num_v_heads / num_k_heads, as
transformers' repeat_interleave pairs them. The PyTorch reference of a decode step (one token per
sequence) is `fused_recurrent_gated_delta_ref`, which is ember.ops.gated_delta.recurrent over the
gathered states.

The program walks its sequence's tokens (rows `starts[b]` to `starts[b + 1]` of the step's tokens laid
back to back) with the state tile held in registers, storing each token's output and the final tile; a
decode step is the same launch with one token per sequence. It is exact (the recurrence itself, not
the chunked UT-transform form, which agrees to rounding: its reference is ember.ops.gated_delta.chunked)
and simple, at the cost
of a sequential walk over the chunk: a program's work grows with the chunk's length, and the grid is
only sequences x value heads x value blocks wide. A chunked (WY) kernel would put the intra-chunk work
on tensor cores; this one has not been timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def fused_recurrent_gated_delta_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """The kernel's semantics in PyTorch (the state pool updated in place too)."""
    s = state[slots].masked_fill(fresh.bool()[:, None, None, None], 0.0)
    groups = v.shape[1] // q.shape[1]
    qf, kf = (x.float().repeat_interleave(groups, dim=1) for x in (q, k))
    qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    s = s * g.float().exp()[..., None, None]
    delta = (v.float() - (s * kf.unsqueeze(-1)).sum(-2)) * beta.float().unsqueeze(-1)
    s = s + kf.unsqueeze(-1) * delta.unsqueeze(-2)
    state[slots] = s
    return (s * qf.unsqueeze(-1)).sum(-2).to(v.dtype)


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, Hk, K]: the step's prefill tokens, sequence after sequence
    k_ptr,  # [T, Hk, K]
    v_ptr,  # [T, Hv, V]
    g_ptr,  # [T, Hv] float32
    beta_ptr,  # [T, Hv] float32
    state_ptr,  # [S, Hv, K, V] float32
    slots_ptr,  # [B] int64
    fresh_ptr,  # [B] int32: 1 where the sequence has no state yet
    starts_ptr,  # [B + 1] int32: each sequence's first token in q/k/v, then T
    o_ptr,  # [T, Hv, V]
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    hk = hv // (HV // HK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = offs_k < K, offs_v < V
    slot = tl.load(slots_ptr + b)
    fresh = tl.load(fresh_ptr + b)
    start = tl.load(starts_ptr + b)
    end = tl.load(starts_ptr + b + 1)
    tile = state_ptr + ((slot * HV + hv) * K + offs_k[:, None]) * V + offs_v[None, :]
    mask = mk[:, None] & mv[None, :]
    state = tl.load(tile, mask=mask, other=0.0)
    state = tl.where(fresh != 0, 0.0, state)
    scale = 1.0 / tl.sqrt(K * 1.0)
    for t in range(start, end):
        q = tl.load(q_ptr + (t * HK + hk) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + (t * HK + hk) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + (t * HV + hv) * V + offs_v, mask=mv, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        g = tl.load(g_ptr + t * HV + hv)
        beta = tl.load(beta_ptr + t * HV + hv)
        state = state * tl.exp(g)
        delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(state * q[:, None], axis=0)
        tl.store(o_ptr + (t * HV + hv) * V + offs_v, o.to(o_ptr.dtype.element_ty), mask=mv)
    tl.store(tile, state, mask=mask)


def prefill_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    starts: torch.Tensor,
) -> torch.Tensor:
    """The prompt chunks of B sequences in one launch. q, k [T, Hk, K], v [T, Hv, V], g and beta [T, Hv] for
    the sequences' tokens back to back (`starts` [B + 1]: each one's first row, then T), state [S, Hv, K, V]
    float32 (updated in place at `slots` [B]), fresh [B] (nonzero: start from zeros). Returns o [T, Hv, V]
    in v's dtype."""
    hk, kd = q.shape[1:]
    hv, vd = v.shape[1:]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(v)
    block_v = min(triton.next_power_of_2(vd), 64)
    _prefill_kernel[(slots.shape[0], hv, triton.cdiv(vd, block_v))](
        q,
        k,
        v,
        g.float().contiguous(),
        beta.float().contiguous(),
        state,
        slots.to(torch.int64).contiguous(),
        fresh.to(torch.int32).contiguous(),
        starts.to(torch.int32).contiguous(),
        o,
        HK=hk,
        HV=hv,
        K=kd,
        V=vd,
        BLOCK_K=triton.next_power_of_2(kd),
        BLOCK_V=block_v,
    )
    return o
