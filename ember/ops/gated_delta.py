"""The Gated DeltaNet's token mixing (Qwen3-Next's linear-attention layers) in PyTorch, on every device.

Per value head the layer keeps a state S [k_dim, v_dim]; each token t decays it by exp(g_t), writes the
correction beta_t * (v_t - S^T k_t) along k_t (the delta rule), and reads q_t out of it:

    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t / sqrt(k_dim)

with q and k L2-normalised. A decode token runs that update (`recurrent`); a prompt chunk runs the
chunked form (`chunked`): within chunks of 64 tokens the updates are condensed into triangular solves
and matmuls (the UT transform), and only the chunk boundaries are sequential. Both are transformers'
`torch_recurrent_gated_delta_rule` and `torch_chunk_gated_delta_rule` operation for operation, float32
throughout, starting from a given state and returning the final one, so a prompt split over several
steps carries its state from chunk to chunk.

Before the rule, q, k and v pass a causal depthwise convolution whose last kernel-1 inputs are the
other part of a request's state (`causal_conv`).

Both halves of a step are registry choices, each one launch on CUDA that reads and writes the pool's
states in place (ember/kernels/gated_delta.py): the decode update (`registry.gated_delta_decode_impl`:
`TritonRecurrent`, elsewhere `recurrent` over the gathered states, `TorchRecurrent`) and the step's
prompt chunks (`registry.gated_delta_prefill_impl`: `TritonPrefill`, the recurrent update walked over
each chunk's tokens for all sequences at once; elsewhere `chunked` one sequence at a time,
`TorchChunkedPrefill`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.ops.target import Target

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's depthwise causal convolution then SiLU. x [C, T] (a channel's tokens in a row),
    state [C, K-1] (the inputs before x; zeros for a new request), weight [C, K]. Returns the output
    [C, T] in x's dtype and the new state: the last K-1 inputs."""
    full = torch.cat([state.to(weight.dtype), x.to(weight.dtype)], dim=-1)
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]
    return F.silu(out[:, -x.shape[-1] :]).to(x.dtype), full[:, -state.shape[-1] :]


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """[B, T, H*, D] inputs to float32 [B, H, T, D] with one q/k head per value head, q and k L2-normed,
    q scaled by 1/sqrt(k_dim)."""
    groups = v.shape[2] // k.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k, v, beta, g = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v, beta, g)
    ]
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv], state [B, Hv, Dk, Dv]
    float32. Returns the output [B, T, Hv, Dv] in v's dtype and the final state (float32)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    out = torch.zeros_like(v)
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = (state * k[:, :, t].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t].unsqueeze(-1)
        state = state + k[:, :, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, t] = (state * q[:, :, t].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(dtype), state


def chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result in chunks of CHUNK tokens (shapes as `recurrent`)."""
    dtype, length = v.dtype, q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(x.shape[0], x.shape[1], -1, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(g.shape[0], g.shape[1], -1, CHUNK)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pair = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    state = state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :length]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), state


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (statistics in float32, rounded back before the weight), times silu(gate): the
    Gated DeltaNet's output norm, transformers' Qwen3NextRMSNormGated."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    h = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (h * F.silu(gate.to(torch.float32))).to(dtype)


class TritonRecurrent:
    """A decode token per sequence in one Triton launch, the state read and written in place in the pool: the
    prefill kernel over one-token sequences, `starts` [B + 1] (0..B) giving each its row
    (ember/kernels/gated_delta.py)."""

    @staticmethod
    def can_implement(target: Target) -> bool:
        return target.triton

    def __call__(
        self,
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
        from ember.kernels.gated_delta import prefill_gated_delta

        return prefill_gated_delta(q, k, v, g, beta, state, slots, fresh, starts)


class TorchRecurrent:
    """`recurrent` over the sequences' states gathered from the pool, scattered back after."""

    @staticmethod
    def can_implement(target: Target) -> bool:
        return True

    def __call__(
        self,
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
        """q, k [B, Hk, K], v [B, Hv, V], g and beta [B, Hv], state [S, Hv, K, V] (updated at `slots`), fresh
        [B] (True: start from zeros) -> o [B, Hv, V]. `starts` (0..B, the kernel's token rows) is not needed:
        row b is sequence b."""
        start = state[slots].masked_fill(fresh[:, None, None, None], 0.0)
        out, new = recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], start)
        state[slots] = new
        return out[:, 0]


class TritonPrefill:
    """The step's prompt chunks in one Triton launch: per (sequence, value head, value block) the recurrent
    update over the chunk's tokens, the state tile in registers from the pool slot to the pool slot
    (ember/kernels/gated_delta.py). Exact, like `recurrent`; sequential in the chunk's length."""

    @staticmethod
    def can_implement(target: Target) -> bool:
        return target.triton

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        fresh: torch.Tensor,
        starts: torch.Tensor,
        starts_host: list[int],
    ) -> torch.Tensor:
        from ember.kernels.gated_delta import prefill_gated_delta

        return prefill_gated_delta(q, k, v, g, beta, state, slots, fresh, starts)


class TorchChunkedPrefill:
    """`chunked` for each sequence in turn, from its slot's state (zeros where fresh) back to the slot."""

    @staticmethod
    def can_implement(target: Target) -> bool:
        return True

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        fresh: torch.Tensor,
        starts: torch.Tensor,
        starts_host: list[int],
    ) -> torch.Tensor:
        """q, k [T, Hk, K], v [T, Hv, V], g and beta [T, Hv] for B sequences back to back (`starts_host`
        [B + 1]: each one's first row, then T; `starts` the same on the device), state [S, Hv, K, V]
        (updated at `slots` [B]), fresh [B] (True: start from zeros) -> o [T, Hv, V]."""
        out = torch.empty_like(v)
        for i in range(slots.shape[0]):
            lo, hi, slot = starts_host[i], starts_host[i + 1], slots[i : i + 1]
            start = state[slot].masked_fill(fresh[i : i + 1, None, None, None], 0.0)
            o, state[slot] = chunked(
                q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], g[None, lo:hi], beta[None, lo:hi], start
            )
            out[lo:hi] = o[0]
        return out
