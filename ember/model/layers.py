"""Building blocks of the decoder: RMSNorm, rotary embedding, gated MLP; their kernels are the registry's
choice (ember/ops), made when each is built.

Numerics follow Hugging Face's reference implementations (norm statistics and rotary tables in
float32) so that greedy outputs match token for token.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.model.linear import fp8_input_layout
from ember.ops import registry, rotary
from ember.ops.target import Target
from ember.quant.formats import Fp8Activation, Fp8Layout


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add that precedes it (see ember/ops/norm.py).

    With `residual`, returns (norm(x + residual), x + residual), the sum rounded to the model
    dtype first, exactly as HF computes `residual + hidden_states` and then normalises. Given `fp8`,
    the layout of the one fp8 linear that reads the norm's output (QuantLinear.fp8_layout), the output
    comes quantized in it (an Fp8Activation) where a fused kernel runs here, else as a tensor.
    """

    style = "llama"

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        target = registry.target(self.weight.device, self.weight.dtype)
        self._impl = registry.norm_impl(target, self.style)
        self._fp8 = registry.fp8_norm_impl(target, self.style)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8: Fp8Layout | None = None):
        if fp8 is not None and self._fp8 is not None:
            return self._fp8(x, residual, self.scale(), self.eps, fp8)
        return self._impl(x, residual, self.scale(), self.eps)

    def scale(self) -> torch.Tensor:
        """What the normalised input is multiplied by."""
        return self.weight


class WeightlessRMSNorm(RMSNorm):
    """RMSNorm without a learned scale (Llama 4's QK L2 norm): its weight is a buffer of ones, which no
    checkpoint holds."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        ones = self.weight.data
        del self.weight
        self.register_buffer("weight", ones, persistent=False)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm scales by (1 + w), with w as the checkpoint stores it (initialised to 0), in
    float32 (see ember/ops/norm.py, TorchGemmaRMSNorm)."""

    style = "gemma"

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        self.weight.data.zero_()

    def scale(self) -> torch.Tensor:
        return self.weight.float() + 1.0


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("default", None):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "longrope":
        return _longrope_inv_freq(head_dim, theta, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if rope_type == "freq_factors":  # llama.cpp's rope_freqs tensor: each frequency's divisor (ember/model/gguf_moe.py)
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
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
    raise ValueError(
        f"rope_scaling: unsupported rope type {rope_type!r} "
        "(supported: default, linear, llama3, longrope, yarn, freq_factors)"
    )


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
    """Neox-style rotary embedding's tables: a precomputed cos/sin row per position, shared by the layers
    that use them; each layer rotates through the implementation it chose (ember/ops/rotary.py).

    Only the first `rotary_dim` channels of a head are rotated (partial_rotary_factor < 1, as in
    Phi-4-mini); the rest pass through unchanged. `sin_signed` is sin with its first half negated, what
    the PyTorch path and the native kernels multiply roll(x, D / 2) by. The rows for a step's positions
    are looked up once and reused by every layer.

    M-RoPE (Qwen2.5-VL, `mrope_section`): positions come as [3, T] (a token's temporal, height and width
    positions) and channel pair j rotates by the position of its section (the first `mrope_section[0]`
    pairs by the temporal one, and so on), so a token's row is the table's row of each channel's own
    position: one gather, the same values as transformers' per-section concatenation. [T] positions
    still work (text: the three positions agree). The fused rotary-and-store kernels and the native
    decode read one position per token, so an M-RoPE layer offers them no tables (`full_tables`).
    """

    # buffers (register_buffer): a row per position
    cos: torch.Tensor
    sin: torch.Tensor
    sin_signed: torch.Tensor
    section: torch.Tensor | None  # M-RoPE: each channel's position row (0, 1, 2), [rotary_dim]

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        rotary_dim: int | None = None,
        mrope_section: tuple[int, int, int] | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        inv_freq = _inv_freq(self.rotary_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # LongRoPE and YaRN scale cos and sin (so each attention logit) by their attention_factor, as HF does.
        scale = 1.0
        if scaling is not None and scaling.get("rope_type") in ("longrope", "yarn"):
            scale = float(scaling["attention_factor"])
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)
        half = self.rotary_dim // 2
        self.register_buffer(
            "sin_signed", torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1), persistent=False
        )
        section = None
        if mrope_section is not None:
            if sum(mrope_section) != half:
                raise ValueError(f"mrope_section {mrope_section} must add up to rotary_dim / 2 = {half}")
            section = torch.cat([torch.full((n,), i) for i, n in enumerate(mrope_section)]).repeat(2)
        self.register_buffer("section", section, persistent=False)
        self._step: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D], rotated by the implementation the registry gives these tensors (a
        direct call; the model's layers call the one they chose at load)."""
        return self.implementation(registry.target(q.device, q.dtype), q.shape[-1])(self, positions, q, k)

    def rotate_qk(
        self, positions: torch.Tensor, qk: torch.Tensor, num_q_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for queries and keys that are adjacent in each row: qk is [T, Hq + Hk, D], the query
        heads first (the fused QKV output's first columns)."""
        impl = self.implementation(registry.target(qk.device, qk.dtype), qk.shape[-1])
        return impl.rotate_qk(self, positions, qk, num_q_heads)

    def implementation(self, target: Target, head_dim: int) -> rotary.TorchRotary | rotary.TritonRotary:
        return registry.rotary_impl(target, self.rotary_dim == head_dim)

    def full_tables(self, head_dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cos and signed sin tables [max_positions, head_dim] when every channel of a head is rotated
        by one position per token (what the native fused rotary reads), else None."""
        return (self.cos, self.sin_signed) if self.rotary_dim == head_dim and self.section is None else None

    def rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows for `positions` ([T], or [3, T] with M-RoPE), [T, 1, D]. Held while the
        same positions tensor (a step's, passed to every layer) keeps coming; the reference keeps its id
        from being reused."""
        if self._step is None or self._step[0] is not positions or self._step[1] != dtype:
            cos, sin = self.token_tables(positions, self.sin_signed)
            self._step = (positions, dtype, cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype))
        return self._step[2], self._step[3]

    def token_tables(self, positions: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's float32 cos row and `sin` row (this module's `sin` or `sin_signed`), [T, D]: the
        tables' rows at `positions` [T], or with M-RoPE at [3, T] each channel's row of its own section."""
        if positions.dim() == 1:
            return self.cos[positions], sin[positions]
        assert self.section is not None, "[3, T] positions are M-RoPE's (mrope_section)"
        rows = positions[self.section].t().contiguous()  # [T, D]: each channel's position
        cols = torch.arange(self.rotary_dim, device=positions.device)
        return self.cos[rows, cols], sin[rows, cols]


class Embedding(nn.Embedding):
    """Token embedding that can also act as a tied LM head."""

    def attend(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


class GatedMLP(nn.Module):
    """Gated feed-forward with the gate and up projections fused into one matmul: SwiGLU, or GELU-tanh
    (Gemma, transformers' "gelu_pytorch_tanh"). The activation's implementation (ember/ops/activation.py)
    is chosen when the layer is built and again once its projections are loaded or quantized
    (`choose_kernels`): a native gate/up weight fuses its GEMV with SiLU."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act: unsupported activation {act!r} (supported: silu, gelu_pytorch_tanh)")
        self.act = act
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self._target = registry.target(self.down_proj.weight.device, self.down_proj.weight.dtype)
        self.choose_kernels()

    def choose_kernels(self) -> None:
        self._act = registry.activation_impl(self._target, self.act, self.gate_up_proj)
        self._act_fp8 = registry.fp8_activation_impl(self._target, self.act)

    def fp8_input_layout(self, rows: int) -> Fp8Layout | None:
        """The layout in which `forward` takes `rows` rows already quantized (see QuantLinear.fp8_layout)."""
        return fp8_input_layout(self.gate_up_proj, rows)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        rows = x.rows if isinstance(x, Fp8Activation) else x.shape[0]
        down = None if self._act_fp8 is None else fp8_input_layout(self.down_proj, rows)
        if self._act_fp8 is None or down is None:
            return self.down_proj(self._act(self.gate_up_proj, x))
        return self.down_proj(self._act_fp8(self.gate_up_proj, x, down))
