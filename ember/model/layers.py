"""Building blocks of the decoder: RMSNorm, rotary embedding, gated MLP.

Numerics follow Hugging Face's reference implementations (norm statistics and rotary tables in
float32) so that greedy outputs match token for token.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.cpu_native import ops as native
from ember.model.backend import use_triton
from ember.quant.linear import QuantLinear


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add that precedes it (one kernel on CUDA, one native
    call on CPU in float32: ember/cpu_native).

    With `residual`, returns (norm(x + residual), x + residual), the sum rounded to the model
    dtype first, exactly as HF computes `residual + hidden_states` and then normalises.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if use_triton(x):
            from ember.kernels import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if _native_norm_fits(x, residual, self.weight):
            return _native_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the same float32 ops in one call, bit for bit (tests/test_layers.py); in other dtypes it
            # rounds differently from HF
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _native_norm_fits(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether the native residual add + norm (ember/cpu_native) takes these: contiguous float32 [M, N]
    rows on CPU, a float32 weight; other dtypes round as HF does, through the PyTorch ops."""
    return (x.dtype == weight.dtype == torch.float32 and x.dim() == 2 and x.is_cpu and x.is_contiguous()
            and (residual is None or (residual.dtype == torch.float32 and residual.is_contiguous()))
            and native.available())


def _native_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One native call for what the PyTorch path does in two or three ops (a decode step makes 61)."""
    if residual is None:
        return native.rms_norm(x, weight, eps)
    return native.add_rms_norm(x, residual, weight, eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm scales by (1 + w), with w as the checkpoint stores it (initialised to 0).

    As transformers computes it: the normalised input times 1 + w, both in float32, rounded to x's
    dtype once at the end (Llama rounds before scaling). The Triton kernels get the float32 1 + w and
    round before scaling, which equals this in float32 only."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        self.weight.data.zero_()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        weight = self.weight.float() + 1.0
        if use_triton(x):
            from ember.kernels import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, weight, self.eps)
            return fused_add_rms_norm(x, residual, weight, self.eps)
        if _native_norm_fits(x, residual, weight):
            return _native_norm(x, residual, weight, self.eps)
        if residual is not None:
            x = x + residual
            return F.rms_norm(x.float(), weight.shape, weight, self.eps).to(x.dtype), x
        return F.rms_norm(x.float(), weight.shape, weight, self.eps).to(x.dtype)


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in ("default", None):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "longrope":
        return _longrope_inv_freq(head_dim, theta, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_scaling: unsupported rope type {rope_type!r} (supported: default, linear, llama3, "
                     "longrope, yarn)")


def _longrope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """LongRoPE (Phi-3): one stretch factor per frequency, the long set when the engine's sequences may
    outgrow the pre-training length (see ModelConfig.for_max_model_len)."""
    which = "long_factor" if scaling["use_long_factors"] else "short_factor"
    ext = torch.tensor(scaling[which], dtype=torch.float32)
    if ext.numel() != rotary_dim // 2:
        raise ValueError(f"rope_scaling: {which} has {ext.numel()} values, expected rotary_dim / 2 = {rotary_dim // 2}")
    return 1.0 / (ext * theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _yarn_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (gpt-oss): frequencies rotating fewer than beta_slow times over the pre-training length are
    interpolated (divided by factor), those rotating more than beta_fast times kept, a linear ramp
    between; transformers' `_compute_yarn_parameters` operation for operation, so the float32 table is
    its table. `scaling` comes resolved by ember.config (every default filled in)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    extrapolation = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) with a precomputed cos/sin table per position.

    Only the first `rotary_dim` channels of a head are rotated (partial_rotary_factor < 1, as in
    Phi-4-mini); the rest pass through unchanged.

    On CPU, rotate_half(x) * sin is computed as roll(x, D / 2) * sin_signed, sin with its first half
    negated: the same products bit for bit, in one op instead of four. The rows for a step's
    positions are looked up once and reused by every layer, which all share this module.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        inv_freq = _inv_freq(self.rotary_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # LongRoPE and YaRN scale cos and sin (so each attention logit) by their attention_factor, as HF does.
        scale = float(scaling["attention_factor"]) if (scaling or {}).get("rope_type") in ("longrope", "yarn") else 1.0
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)
        half = self.rotary_dim // 2
        self.register_buffer("sin_signed", torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1),
                             persistent=False)
        self._step: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]."""
        rot = self.rotary_dim
        if rot == q.shape[-1]:
            return self._rotate(positions, q, k)
        q_rot, k_rot = self._rotate(positions, q[..., :rot], k[..., :rot])
        return torch.cat((q_rot, q[..., rot:]), dim=-1), torch.cat((k_rot, k[..., rot:]), dim=-1)

    def rotate_qk(self, positions: torch.Tensor, qk: torch.Tensor, num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for queries and keys that are adjacent in each row: qk is [T, Hq + Hk, D], the query
        heads first (the fused QKV output's first columns). On CPU with every channel rotated, one pass
        over both: four operator calls per layer instead of eight, bit for bit the same products."""
        if use_triton(qk) or self.rotary_dim != qk.shape[-1]:
            return self.forward(positions, qk[:, :num_q_heads], qk[:, num_q_heads:])
        cos, sin = self._rows(positions, qk.dtype)
        out = (qk * cos).add_(qk.roll(qk.shape[-1] // 2, dims=-1) * sin)
        return out[:, :num_q_heads], out[:, num_q_heads:]

    def full_tables(self, head_dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cos and signed sin tables [max_positions, head_dim] when every channel of a head is rotated
        (what the native fused rotary reads), else None."""
        return (self.cos, self.sin_signed) if self.rotary_dim == head_dim else None

    def _rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if use_triton(q):
            from ember.kernels import apply_rotary

            return apply_rotary(positions, q, k, self.cos, self.sin)
        cos, sin = self._rows(positions, q.dtype)
        half = q.shape[-1] // 2
        return (q * cos).add_(q.roll(half, dims=-1) * sin), (k * cos).add_(k.roll(half, dims=-1) * sin)

    def _rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows for `positions`, [T, 1, D]. Held while the same positions tensor
        (a step's, passed to every layer) keeps coming; the reference keeps its id from being reused."""
        if self._step is None or self._step[0] is not positions or self._step[1] != dtype:
            cos = self.cos[positions].unsqueeze(1).to(dtype)
            sin = self.sin_signed[positions].unsqueeze(1).to(dtype)
            self._step = (positions, dtype, cos, sin)
        return self._step[2], self._step[3]


class Embedding(nn.Embedding):
    """Token embedding that can also act as a tied LM head."""

    def attend(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


class GatedMLP(nn.Module):
    """Gated feed-forward with the gate and up projections fused into one matmul: SwiGLU, or GELU-tanh
    (Gemma, transformers' "gelu_pytorch_tanh"; no fused kernel, PyTorch ops on every device)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act: unsupported activation {act!r} (supported: silu, gelu_pytorch_tanh)")
        self.act = act
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "silu" and isinstance(self.gate_up_proj, QuantLinear):
            fused = self.gate_up_proj.native_silu_and_mul(x)  # CPU: GEMV and activation in one call
            if fused is not None:
                return self.down_proj(fused)
        gate_up = self.gate_up_proj(x)
        if self.act == "gelu_pytorch_tanh":
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if use_triton(x):
            from ember.kernels import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
