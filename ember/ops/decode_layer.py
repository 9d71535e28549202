"""A whole Llama decoder layer's decode step in one native call (ember/cpu_native `decode_layer`).

The layer (ember.model.llama.DecoderLayer) is read through the attributes its modules have, not their
classes, so this module stays below the model's.
"""

from __future__ import annotations

from typing import Any

import torch

from ember.cpu_native import ops as native
from ember.distributed import tp_size
from ember.ops.attention import AttentionMetadata
from ember.ops.linear_native import native_expand_min_rows
from ember.ops.target import Target


class NativeDecodeLayer:
    """A CPU decode step of a plain Llama layer on native weights: the whole layer in one native call
    (ops.decode_layer), bit for bit the native calls its modules make one by one, without their ~70 us
    of Python a layer. Per call, None where the modules run: prefill rows, rows from the projections'
    GEMV crossover on, tensors the kernel does not take."""

    @staticmethod
    def can_implement(target: Target, layer: Any) -> bool:
        return target.native and decode_layer_weights(layer) is not None

    def __init__(self, layer: Any) -> None:
        w = decode_layer_weights(layer)
        if w is None:
            raise ValueError("NativeDecodeLayer: the layer is not one the native decode computes (see can_implement)")
        self.weights = w
        self.cos, self.sin_signed = layer.self_attn.fused_rotary_tables()
        # rows below every projection's GEMV crossover
        self.max_rows = min(native_expand_min_rows(nat) for nat in (w.qkv, w.o, w.gate_up, w.down))

    def __call__(
        self,
        positions: torch.Tensor,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if (
            meta.num_decodes != h.shape[0]
            or h.shape[0] >= self.max_rows
            or k_cache is None
            or v_cache is None
            or not native.decode_layer_fits(self.weights, h, residual, k_cache, positions, meta.slot_mapping)
        ):
            return None
        return native.decode_layer(
            self.weights,
            h,
            residual,
            positions,
            self.cos,
            self.sin_signed,
            k_cache,
            v_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
        )


def decode_layer_weights(layer: Any) -> native.DecodeLayerWeights | None:
    """What `ops.decode_layer` needs of `layer`, where it computes what the layer's modules do: two plain
    RMSNorms, full neox rotary, no bias but Qwen2's on QKV, no QK norm but Qwen3's, no sinks, an unscaled
    cache, a SiLU gated MLP, every projection one native weight, one rank."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if (
        layer.sandwich
        or tp_size() != 1
        or getattr(mlp, "act", None) != "silu"
        or not all(map(_plain_rms_norm, norms))
        or norms[0].eps != norms[1].eps
        or attn.sinks is not None
        or not _plain_qk_norm(attn)
        or attn.fused_rotary_tables() is None
    ):
        return None
    # native weights exist only on CPU where the kernels were built at load (so no GPU model builds them)
    qkv = _native_gemv(attn.qkv_proj, "native_gemv_parts")
    o, gate_up, down = (
        _native_gemv(lin, "native_gemv_weight") for lin in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    )
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    q_norm, k_norm = (None if n is None else n.weight.detach().contiguous() for n in (attn.q_norm, attn.k_norm))
    return native.DecodeLayerWeights(
        norms[0].weight.detach().contiguous(),
        norms[1].weight.detach().contiguous(),
        norms[0].eps,
        qkv[0],
        o,
        gate_up,
        down,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        attn.scale,
        attn.sliding_window or 0,
        attn.logits_soft_cap or 0.0,
        q_norm,
        k_norm,
        attn.q_norm.eps if attn.q_norm is not None else 0.0,
        None if qkv[1] is None else qkv[1].contiguous(),
    )


def _native_gemv(linear: Any, method: str) -> Any:
    """A quantized layer's native GEMV (QuantLinear's `method`); None for a dense nn.Linear."""
    get = getattr(linear, method, None)
    return None if get is None else get()


def _plain_rms_norm(norm: Any) -> bool:
    """Llama's RMSNorm (not Gemma's 1 + w) with a float32 weight: what the kernels' RMSNorm computes."""
    return getattr(norm, "style", None) == "llama" and norm.weight.dtype == torch.float32


def _plain_qk_norm(attn: Any) -> bool:
    """No QK norm, or Qwen3's: plain RMSNorms over each head, one eps."""
    if attn.q_norm is None:
        return True
    return _plain_rms_norm(attn.q_norm) and _plain_rms_norm(attn.k_norm) and attn.q_norm.eps == attn.k_norm.eps
