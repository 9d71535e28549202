"""DeepSeek's multi-head latent attention (MLA; DeepSeek-V2, V2-Lite, V3), as transformers'
DeepseekV2Attention / DeepseekV3Attention compute it, over Ember's paged cache.

Per token the cache holds one row of `kv_lora_rank + qk_rope_head_dim` values (ember.model.hf_config's
MlaConfig.cache_dim): the normalised latent c (kv_a_proj_with_mqa, kv_a_layernorm) and the rotated key
k_pe that every head shares. There is no V tensor: the pool is one [num_blocks, block_size, 1, cache_dim]
tensor per layer (ember.runner.kv_cache, `latent=True`), 576 values a token for V2/V3 against 2 x 128
heads x 192 for their decompressed keys and values; in e4m3 with `--kv-cache-dtype fp8` (one byte a value).

Prefill chunks decompress their sequence's cached latents (kv_b_proj: each head's unrotated key and its
value) and attend as multi-head attention; one-token queries never decompress: the query's unrotated part
is folded through kv_b_proj's key rows (W_UK) into the latent space, attends over the cached rows directly
(MQA with a 576-wide key and its first 512 values as the value), and the result goes through kv_b_proj's
value rows (W_UV). Which code does that is the registry's choice (ember/ops/mla.py): PyTorch ops, or a
Triton kernel over the paged rows.

DeepSeek pairs the rotated channels as (0, 1), (2, 3), ...; transformers rotates them as neox halves of the
de-interleaved channels (even ones, then odd ones), which is what `forward` does before Ember's rotary.

Between the projections and the attention, a step normalises the latent (kv_a_layernorm), rotates the
query's and the key's rotated channels and stores the cache row: on the Triton path one kernel does all of
it from the projections' outputs (TritonMLA.prepare, ember/kernels/mla_prep.py: one launch a layer where
the separate ops take about 7), given the rotary's full tables (RotaryEmbedding.full_tables; DeepSeek's
YaRN tables are); elsewhere, or without them, the layer's own ops run (`_prepare_unfused`), the same
values bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.model.hf_config import ModelConfig
from ember.model.layers import RMSNorm, RotaryEmbedding
from ember.model.sharding import ShardLayout
from ember.ops import registry
from ember.ops.attention import AttentionMetadata
from ember.ops.mla import AbsorbedWeights, LatentPrep, MlaShape
from ember.quant.formats import Fp8Layout

_LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with the default eps, not rms_norm_eps


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: ShardLayout, rotary: RotaryEmbedding | None, layer: int) -> None:
        super().__init__()
        assert rotary is not None, "every MLA layer rotates its rope channels (DeepSeek has no NoPE layers)"
        mla = cfg.mla
        assert mla is not None, "DecoderLayer builds it for configs with MLA"
        self.num_heads = layout.num_heads
        self.nope, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        self.scale = mla.softmax_scale
        hidden, qk = cfg.hidden_size, self.nope + self.rope_dim
        self.q_lora_rank = mla.q_lora_rank
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=False)
        self.rotary = rotary
        self._target = registry.target(self.o_proj.weight.device, self.o_proj.weight.dtype)
        self._rope = rotary.implementation(self._target, self.rope_dim)
        # even channels, then odd ones: DeepSeek's pairs as the neox halves Ember's rotary turns
        perm = torch.cat([torch.arange(0, self.rope_dim, 2), torch.arange(1, self.rope_dim, 2)])
        self._deinterleave = perm.to(self.o_proj.weight.device) if mla.rope_interleave else None
        self.cache: torch.Tensor | None = None
        # fp8 latent cache: stored = row / kv_scale, the fp8 KV cache's rule with the row as the one KV head;
        # 1.0 (as for other layers' k_scale and v_scale, uncalibrated) keeps |row| <= 448 to e4m3's mantissa
        self.kv_scale = 1.0
        self._absorbed: AbsorbedWeights | None = None
        self._prep: LatentPrep | None = None

    def bind_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> None:
        """This layer's latent cache [num_blocks, block_size, 1, cache_dim] (no V: `v_cache` is None), or
        None: released. The absorbed weights are taken from kv_b_proj as loaded (quantized or not)."""
        assert v_cache is None, "an MLA layer keeps one latent row per token, no separate values"
        self.cache = k_cache
        if k_cache is None:
            self._absorbed = None
            return
        shape = MlaShape(k_cache.dtype, self.num_heads, self.kv_lora_rank, self.rope_dim, k_cache.shape[1])
        self._mla = registry.mla_impl(self._target, shape)
        self._absorbed = self.absorbed_weights()
        self._prep = self.latent_prep()

    def latent_prep(self) -> LatentPrep | None:
        """What a fused prep reads (ember/ops/mla.py), or None where the rotary offers no full tables."""
        tables = self.rotary.full_tables(self.rope_dim)
        if tables is None:
            return None
        norm = self.kv_a_layernorm
        return LatentPrep(*tables, norm.weight, norm.eps, self._deinterleave is not None)

    @torch.no_grad()
    def absorbed_weights(self) -> AbsorbedWeights:
        """kv_b_proj's weight [H * (nope + v), L], as the layer computes it, split per head into W_UK
        [H, nope, L] and W_UV^T [H, L, v]: kv_b_proj of the identity, so a quantized layer gives its own
        dequantized weight."""
        weight = getattr(self.kv_b_proj, "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            eye = torch.eye(self.kv_lora_rank, dtype=self._target.dtype, device=self._target.device)
            weight = self.kv_b_proj(eye).t()
        w = weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return AbsorbedWeights(w[:, : self.nope].contiguous(), w[:, self.nope :].transpose(1, 2).contiguous())

    def fp8_input_layout(self, rows: int) -> Fp8Layout | None:
        """Two projections read the norm's output (the query's and the latent's), so it comes as a tensor."""
        return None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        cache, absorbed = self.cache, self._absorbed
        assert cache is not None and absorbed is not None, "bind_cache sets the latent cache before any step"
        tokens = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(tokens, self.num_heads, self.nope + self.rope_dim).split([self.nope, self.rope_dim], -1)
        kv = self.kv_a_proj_with_mqa(x)
        fused = None
        if self._prep is not None:
            fused = self._mla.prepare(positions, q_pe, kv, self._prep, cache, meta.slot_mapping, self.kv_scale)
        q_pe = self._prepare_unfused(positions, q_pe, kv, cache, meta.slot_mapping) if fused is None else fused
        o = self._mla(q_nope, q_pe, cache, meta, absorbed, self.kv_b_proj, self.scale, self.kv_scale)
        return self.o_proj(o.reshape(tokens, self.num_heads * self.v_dim))

    def _prepare_unfused(
        self, positions: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """The latent's norm, the rotary (after de-interleaving) and the cache row's store as separate ops:
        the rotated q_pe [T, H, rope]."""
        latent, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        k_pe = k_pe.unsqueeze(1)
        if self._deinterleave is not None:
            q_pe, k_pe = q_pe[..., self._deinterleave], k_pe[..., self._deinterleave]
        q_pe, k_pe = self._rope(self.rotary, positions, q_pe.contiguous(), k_pe.contiguous())
        self._mla.store(torch.cat([latent, k_pe.squeeze(1)], dim=-1), cache, slots, self.kv_scale)
        return q_pe
