"""Llama decoder layers' decode step in one native call (ember/cpu_native `decode_layers`).

The layer (ember.model.llama.DecoderLayer) is read through the attributes its modules have, not their
classes, so this module stays below the model's.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from ember.cpu_native import ops as native
from ember.distributed import tp_size
from ember.ops.attention import AttentionMetadata
from ember.ops.linear_native import native_expand_min_rows
from ember.ops.target import Target


class NativeDecodeLayers:
    """A CPU decode step of consecutive plain Llama layers on native weights in one native call
    (ops.decode_layers), bit for bit the native calls their modules make one by one: a layer's (chosen per
    layer, for the layers the model's single call does not cover), or the whole model's (DecoderModel:
    without the Python between layers, ~1 ms of the default model's 8 ms step, 2026-12-05). The layers'
    fixed arguments are packed once and again only when their KV caches are bound anew. Per call, None
    where the modules run: prefill rows, rows from the projections' GEMV crossover on, tensors the kernel
    does not take."""

    @staticmethod
    def can_implement(target: Target, *layers: Any) -> bool:
        return target.native and bool(layers) and all(decode_layer_weights(layer) is not None for layer in layers)

    def __init__(self, *layers: Any) -> None:
        weights = [decode_layer_weights(layer) for layer in layers]
        if not layers or None in weights:
            raise ValueError("NativeDecodeLayers: a layer the native decode does not compute (see can_implement)")
        self._weights = cast(list[native.DecodeLayerWeights], weights)
        self._attns = [layer.self_attn for layer in layers]
        lora = _native_lora(layers[0].self_attn.qkv_proj)
        self._lora = None if lora is None else lora[1]  # the LoRABatch every wrapped projection reads
        # rows below every projection's GEMV crossover
        self.max_rows = min(
            native_expand_min_rows(nat) for w in self._weights for nat in (w.qkv, w.o, w.gate_up, w.down)
        )
        self._caches: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        self._records: torch.Tensor | None = None

    def __call__(
        self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if (
            meta.num_decodes != h.shape[0]
            or h.shape[0] >= self.max_rows
            or not native.decode_layers_fit(h, residual, positions, meta.slot_mapping)
        ):
            return None
        records = self._records if self._bound() else self._pack()
        if records is None:
            return None
        lora_slots = self._lora.slots[: h.shape[0]] if self._lora is not None and self._lora.active else None
        return native.decode_layers(
            records, h, residual, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, lora_slots
        )

    def _bound(self) -> bool:
        """Whether the records were packed with the caches the layers hold now."""
        return len(self._caches) == len(self._attns) and all(
            a.k_cache is k and a.v_cache is v for a, (k, v) in zip(self._attns, self._caches)
        )

    def _pack(self) -> torch.Tensor | None:
        """The layers' records with their current caches; None (until they change) where one does not fit."""
        self._caches = [(a.k_cache, a.v_cache) for a in self._attns]
        self._records = None
        rows = []
        for w, attn, (k, v) in zip(self._weights, self._attns, self._caches):
            tables = attn.fused_rotary_tables()
            if k is None or v is None or tables is None or not native.layer_caches_fit(w, k, v):
                return None
            rows.append(native.layer_record(w, tables[0], tables[1], k, v))
        self._records = torch.tensor(rows, dtype=torch.int64)
        return self._records


def decode_layer_weights(layer: Any) -> native.DecodeLayerWeights | None:
    """What `ops.decode_layers` needs of `layer`, where it computes what the layer's modules do: two plain
    RMSNorms, full neox rotary, no bias but Qwen2's on QKV, no QK norm but Qwen3's, no sinks, no attention
    chunk or query temperature (Llama 4), an unscaled
    cache, a SiLU gated MLP, every projection one native weight, one rank; LoRA on every projection (the
    native slots of ember.model.lora's LoRALinear) or on none."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if (
        not hasattr(attn, "qkv_proj")  # multi-head latent attention (DeepSeek) projects otherwise
        or layer.sandwich
        or tp_size() != 1
        or getattr(mlp, "act", None) != "silu"
        or not all(map(_plain_rms_norm, norms))
        or norms[0].eps != norms[1].eps
        or attn.sinks is not None
        or attn.attention_chunk is not None
        or attn.temperature is not None
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
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    loras = [_native_lora(lin) for lin in projections]
    wrapped = [hasattr(lin, "native_lora") for lin in projections]
    if any(wrapped) and (not all(wrapped) or None in loras):
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
        None if not any(wrapped) else tuple(lora[0] for lora in loras if lora is not None),
    )


def _native_gemv(linear: Any, method: str) -> Any:
    """A quantized layer's native GEMV (QuantLinear's `method`); None for a dense nn.Linear."""
    get = getattr(linear, method, None)
    return None if get is None else get()


def _native_lora(linear: Any) -> Any:
    """A LoRA-wrapped projection's (native slots, LoRABatch) (LoRALinear.native_lora); None otherwise."""
    get = getattr(linear, "native_lora", None)
    return None if get is None else get()


def _plain_rms_norm(norm: Any) -> bool:
    """Llama's RMSNorm (not Gemma's 1 + w) with a float32 weight: what the kernels' RMSNorm computes."""
    return getattr(norm, "style", None) == "llama" and norm.weight.dtype == torch.float32


def _plain_qk_norm(attn: Any) -> bool:
    """No QK norm, or Qwen3's: plain RMSNorms over each head, one eps."""
    if attn.q_norm is None:
        return True
    return _plain_rms_norm(attn.q_norm) and _plain_rms_norm(attn.k_norm) and attn.q_norm.eps == attn.k_norm.eps
