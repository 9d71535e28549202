"""Qwen3-Next: a hybrid decoder whose layers mix tokens by Gated DeltaNet linear attention (most of them)
or by gated full attention (every fourth, by `layer_types`), each followed by a mixture of experts with
a shared expert (ember/model/moe.py). Every RMSNorm scales by (1 + w), Gemma's style, except the
DeltaNet's gated output norm.

A Gated DeltaNet layer keeps, per request, a convolution state (the last kernel-1 inputs of its causal
depthwise convolution, [conv_dim, kernel-1]) and a recurrent state ([v_heads, k_dim, v_dim], float32)
in a pool of slots beside the paged KV cache (ember/runner/linear_state.py); the step's metadata gives
each sequence its slot (`AttentionMetadata.state_slots`) and says whether its context before the step is
empty (`state_fresh`): such a sequence starts from zeros, so a slot needs no clearing when a request takes
it, and a preempted request simply recomputes its prompt. Both are filled once per step in the runner's
persistent input buffers, so the layers copy nothing to the device. The mixing itself is
ember/ops/gated_delta.py's, each half batched over the step's sequences: the delta rule over prompt chunks
(Triton on CUDA, the chunked rule per sequence elsewhere) and the recurrent update for decode tokens. The
convolution of a prompt chunk runs per sequence in PyTorch.

The full-attention layers are Ember's paged attention (ember/model/llama.py) with two changes: q_proj
gives each head its query and an output gate side by side ([q_h, gate_h] per head), and the output is
multiplied by sigmoid(gate) before o_proj. Only these layers have KV; `attention_layers` lists them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed import all_reduce
from ember.errors import ModelLoadError
from ember.model.hf_config import LinearAttentionConfig, ModelConfig
from ember.model.layers import GemmaRMSNorm, RotaryEmbedding
from ember.model.llama import Attention, CausalLM, DecoderModel
from ember.model.moe import make_mlp
from ember.model.sharding import ShardLayout
from ember.ops import gated_delta, registry
from ember.ops.attention import AttentionMetadata
from ember.ops.unfused import Unfused
from ember.quant.formats import Fp8Activation

ARCHITECTURE = "Qwen3NextForCausalLM"


class GatedAttention(Attention):
    """Full attention whose q_proj also yields a sigmoid gate on each head's output."""

    def __init__(self, cfg: ModelConfig, layout: ShardLayout, rotary: RotaryEmbedding | None, layer: int) -> None:
        super().__init__(cfg, layout, rotary, layer)
        self.qkv_proj = nn.Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)

    @property
    def qkv_sizes(self) -> list[int]:
        return [2 * self.q_size, self.kv_size, self.kv_size]

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | Fp8Activation, meta: AttentionMetadata
    ) -> torch.Tensor:
        qg, kv = self.qkv_proj(x).split([2 * self.q_size, 2 * self.kv_size], dim=-1)
        q, gate = qg.reshape(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        qkv = torch.cat([q.reshape(-1, self.q_size), kv], dim=-1)
        o = self.attend(positions, qkv, meta).reshape(-1, self.q_size)
        return all_reduce(self.o_proj(o * torch.sigmoid(gate.reshape(-1, self.q_size))))


class _Conv(nn.Module):
    """The depthwise convolution's weight [conv_dim, 1, kernel] under the checkpoint's name (no bias)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class _GatedNorm(nn.Module):
    """The DeltaNet's output RMSNorm (plain w, not 1 + w), gated by silu(z): ember.ops.gated_delta.gated_rms_norm."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_delta.gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer: projections, the causal convolution and delta rule over its slots'
    state, the gated output norm and out_proj."""

    def __init__(self, cfg: ModelConfig, la: LinearAttentionConfig) -> None:
        super().__init__()
        self.la = la
        self.groups = la.num_v_heads // la.num_k_heads  # value heads per key head
        self.key_dim, self.value_dim = la.num_k_heads * la.k_head_dim, la.num_v_heads * la.v_head_dim
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * la.num_v_heads, bias=False)
        self.conv1d = _Conv(la.conv_dim, la.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(la.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(la.num_v_heads))
        self.norm = _GatedNorm(la.v_head_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        # the decode update over the pool: Triton on CUDA, PyTorch elsewhere (ember/ops/gated_delta.py)
        # and the step's prompt chunks over it likewise
        target = registry.target(self.A_log.device, self.A_log.dtype)
        self._recurrent = registry.gated_delta_decode_impl(target)
        self._delta_prefill = registry.gated_delta_prefill_impl(target)
        self.conv_state: torch.Tensor | None = None  # [slots, conv_dim, kernel - 1]
        self.ssm_state: torch.Tensor | None = None  # [slots, v_heads, k_dim, v_dim] float32

    def bind_state(self, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None) -> None:
        """Set this layer's state pool (None: released); ember/runner/linear_state.py allocates it."""
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """transformers' grouped layout: per key head its q, k, then its value heads' v and z; b and a per
        key head likewise. Returns the conv input [T, conv_dim] (q, k, v flat), z [T, Hv, Dv], b, a [T, Hv]."""
        la, t = self.la, x.shape[0]
        qkvz = self.in_proj_qkvz(x).view(t, la.num_k_heads, -1)
        dv = self.groups * la.v_head_dim
        q, k, v, z = qkvz.split([la.k_head_dim, la.k_head_dim, dv, dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, la.num_k_heads, 2 * self.groups).split([self.groups, self.groups], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, la.num_v_heads, la.v_head_dim), b.reshape(t, -1), a.reshape(t, -1)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert self.conv_state is not None and self.ssm_state is not None, "bind_state sets the pool before any step"
        assert meta.state_slots is not None and meta.state_fresh is not None, "a linear-attention model's step"
        mixed, z, b, a = self._split(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = torch.empty_like(z)
        n = meta.num_decodes
        if n:
            out[:n] = self._decode(mixed[:n], beta[:n], g[:n], meta)
        if n < len(meta.seq_lens_host):
            out[meta.query_start_host[n] :] = self._prefill(mixed, beta, g, meta)
        la = self.la
        normed = self.norm(out.reshape(-1, la.v_head_dim), z.reshape(-1, la.v_head_dim))
        return self.out_proj(normed.reshape(x.shape[0], self.value_dim))

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [B, T, conv_dim] -> q, k [B, T, Hk, Dk] and v [B, T, Hv, Dv]."""
        la = self.la
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        shape = conv_out.shape[:2]
        return (
            q.reshape(*shape, la.num_k_heads, la.k_head_dim),
            k.reshape(*shape, la.num_k_heads, la.k_head_dim),
            v.reshape(*shape, la.num_v_heads, la.v_head_dim),
        )

    def _prefill(
        self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The step's prompt chunks (the sequences after its decodes): each sequence's convolution from its
        slot's state (zeros when its context before the chunk is empty), then the delta rule for all of them
        at once (`gated_delta_prefill_impl`), the slots' states advanced past the chunks."""
        assert self.conv_state is not None and self.ssm_state is not None
        assert meta.state_slots is not None and meta.state_fresh is not None
        n, starts, lens = meta.num_decodes, meta.query_start_host, meta.seq_lens_host
        first, weight = starts[n], self.conv1d.weight[:, 0]
        conv_out = torch.empty_like(mixed[first:])
        for seq in range(n, len(lens)):
            lo, hi, slot = starts[seq], starts[seq + 1], meta.state_slots[seq]
            fresh = lens[seq] == hi - lo  # no context before this chunk: the host's copy of state_fresh[seq]
            conv = torch.zeros_like(self.conv_state[slot]) if fresh else self.conv_state[slot]
            out, self.conv_state[slot] = gated_delta.causal_conv(mixed[lo:hi].t(), conv, weight)
            conv_out[lo - first : hi - first] = out.t()
        q, k, v = self._qkv(conv_out.unsqueeze(0))
        local = [s - first for s in starts[n:]]
        return self._delta_prefill(
            q[0],
            k[0],
            v[0],
            g[first:],
            beta[first:],
            self.ssm_state,
            meta.state_slots[n:],
            meta.state_fresh[n:],
            meta.query_start_loc[n:] - first,
            local,
        )

    def _decode(
        self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """One token for each of the step's B decodes, batched: the convolution's last window and one recurrent
        step of the delta rule from each slot's state (zeros for a one-token prompt: `state_fresh`). The
        decodes lead the step one token each, so their query_start_loc[: B + 1] is the 0..B the update walks."""
        assert self.conv_state is not None and self.ssm_state is not None
        assert meta.state_slots is not None and meta.state_fresh is not None
        n = meta.num_decodes
        slots, fresh = meta.state_slots[:n], meta.state_fresh[:n]
        conv = self.conv_state[slots]
        if min(meta.seq_lens_host[:n]) == 1:  # some one-token prompt, known on the host
            conv = conv.masked_fill(fresh[:, None, None], 0)
        weight = self.conv1d.weight[:, 0]
        window = torch.cat([conv.to(weight.dtype), mixed.to(weight.dtype).unsqueeze(-1)], dim=-1)  # [B, C, K]
        conv_out = F.silu((window * weight).sum(-1)).to(mixed.dtype)
        self.conv_state[slots] = window[:, :, 1:].to(self.conv_state.dtype)
        q, k, v = self._qkv(conv_out.unsqueeze(1))
        starts = meta.query_start_loc[: n + 1]
        return self._recurrent(q[:, 0], k[:, 0], v[:, 0], g, beta, self.ssm_state, slots, fresh, starts)


class HybridLayer(nn.Module):
    """A Qwen3-Next decoder layer: (1 + w) norms around a token mixer (Gated DeltaNet or gated attention)
    and the MLP (experts with a shared one, or dense by mlp_only_layers / decoder_sparse_step)."""

    def __init__(self, cfg: ModelConfig, layout: ShardLayout, rotary: RotaryEmbedding | None, layer: int) -> None:
        super().__init__()
        assert cfg.linear_attention is not None, "a Qwen3-Next config (hf_config._linear_attention)"
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.linear = cfg.layer_is_linear(layer)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, cfg.linear_attention)
        else:
            self.self_attn = GatedAttention(cfg, layout, rotary, layer)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_mlp(cfg, layout, layer)

    def forward(
        self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.linear_attn(h, meta) if self.linear else self.self_attn(positions, h, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class HybridDecoderModel(DecoderModel):
    """DecoderModel's embedding, final norm and loop over HybridLayers; no whole-layer native decode."""

    @staticmethod
    def make_layer(cfg: ModelConfig, layout: ShardLayout, rotary: RotaryEmbedding | None, layer: int) -> nn.Module:
        return HybridLayer(cfg, layout, rotary, layer)

    def choose_kernels(self) -> None:
        self._decode = Unfused()


class Qwen3NextForCausalLM(CausalLM):
    decoder_class = HybridDecoderModel

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        if cfg.linear_attention is None:
            raise ModelLoadError(cfg.architecture, "not a Qwen3-Next config (no linear_attention)")
        super().__init__(cfg, max_positions)

    def hybrid_layers(self) -> list[HybridLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, HybridLayer)]

    def attention_layers(self) -> list[Attention]:
        """The full-attention layers: the only ones with KV."""
        return [layer.self_attn for layer in self.hybrid_layers() if not layer.linear]

    def linear_attention_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.hybrid_layers() if layer.linear]

    def init_dummy_weights(self, seed: int) -> None:
        """CausalLM's, then transformers' init where a random draw would not do: the DeltaNet's output norm
        is 1, dt_bias 1, and A = exp(A_log) uniform in [1, 16]."""
        super().init_dummy_weights(seed)
        for layer in self.linear_attention_layers():
            layer.norm.weight.data.fill_(1.0)
            layer.dt_bias.data.fill_(1.0)
            layer.A_log.data.copy_(torch.linspace(1.0, 16.0, layer.A_log.numel()).log())
