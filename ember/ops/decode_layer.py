"""A whole Llama decoder layer's decode step in one native call (ember/cpu_native `decode_layer`)."""

from __future__ import annotations

import torch

from ember.cpu_native import ops as native
from ember.ops.attention import AttentionMetadata
from ember.ops.linear_native import native_expand_min_rows
from ember.ops.target import Target


class NativeDecodeLayer:
    """A CPU decode step of a plain Llama layer on native weights: the whole layer in one native call
    (ops.decode_layer), bit for bit the native calls its modules make one by one, without their ~70 us
    of Python a layer. Per call, None where the modules run: prefill rows, rows from the projections'
    GEMV crossover on, tensors the kernel does not take."""

    @staticmethod
    def can_implement(target: Target, weights: native.DecodeLayerWeights | None,
                      tables: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
        return target.native and weights is not None and tables is not None

    def __init__(self, weights: native.DecodeLayerWeights, tables: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.weights = weights
        self.cos, self.sin_signed = tables
        # rows below every projection's GEMV crossover
        self.max_rows = min(native_expand_min_rows(w) for w in (weights.qkv, weights.o, weights.gate_up, weights.down))

    def __call__(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                 meta: AttentionMetadata, k_cache: torch.Tensor | None,
                 v_cache: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if (meta.num_decodes != h.shape[0] or h.shape[0] >= self.max_rows or k_cache is None
                or not native.decode_layer_fits(self.weights, h, residual, k_cache, positions, meta.slot_mapping)):
            return None
        return native.decode_layer(self.weights, h, residual, positions, self.cos, self.sin_signed, k_cache, v_cache,
                                   meta.slot_mapping, meta.block_tables, meta.seq_lens)
