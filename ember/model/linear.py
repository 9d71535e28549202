"""Linear and embedding layers whose weights stay quantized in memory.

The matmul reads the quantized form on every path; which kernel runs each part of a layer is the
registry's choice (ember/ops/registry.py), made once when the layer is built: on CUDA, Triton's
quantized GEMMs (ember/ops/linear_gpu.py); on CPU, the native kernels (ember/ops/linear_native.py) or
PyTorch's packed int8/int4 CPU operators where the format fits them, and an exact emulation of fp8
(ember/ops/linear_cpu.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ember.cpu_native import ops as native
from ember.ops import registry
from ember.ops.linear_cpu import DenseInt8Linear
from ember.ops.linear_gpu import Fp8Linear
from ember.ops.linear_native import NativeLinear
from ember.ops.screened_argmax import ScreenedArgmax
from ember.quant.formats import (
    Fp8Activation,
    Fp8Layout,
    QuantizedWeight,
    concat_out,
    dequantize,
    same_format,
    widen_int5,
)
from ember.quant.quantize import quantize


class QuantLinear(nn.Module):
    """y = x @ W^T + b with W quantized. `parts` of different formats (GGUF files mix types inside a
    fused q/k/v) run one matmul each and concatenate; parts of one format are fused into one."""

    def __init__(
        self, parts: list[QuantizedWeight | torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
        if len(parts) > 1 and len(quantized) == len(parts):
            quantized = _beside_int8(quantized)
            if same_format(quantized):
                parts = [concat_out(quantized)]
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.out_features = sum(p.out_features if isinstance(p, QuantizedWeight) else p.shape[0] for p in parts)
        target = registry.target(_device(parts[0]), dtype)
        self.matmuls = [registry.linear_impl(target, p, dtype) for p in parts]
        # what stays of each part: a layout that replaced the codes keeps only their shape
        self.parts = [m.weight for m in self.matmuls]
        first = self.matmuls[0]
        self._silu_gemv = first if isinstance(first, NativeLinear) and self.native_gemv_weight() is not None else None
        self._fp8 = first if len(self.matmuls) == 1 and isinstance(first, Fp8Linear) else None

    def fp8_layout(self, rows: int) -> Fp8Layout | None:
        """The layout in which `forward` takes `rows` rows already quantized (an Fp8Activation, from a
        fused norm or activation kernel), where the layer is one fp8 GPU matmul; None: as a tensor only."""
        return None if self._fp8 is None else self._fp8.fp8_layout(rows)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        if isinstance(x, Fp8Activation):
            assert self._fp8 is not None, "only a layer with an fp8_layout takes quantized input"
            return self._biased(self._fp8(x))
        if x.dim() == 2:  # the decoder's [tokens, features]: no reshapes (2 µs a call of a ~25 µs CPU decode GEMV)
            return self._forward_2d(x)
        shape = x.shape
        return self._forward_2d(x.reshape(-1, shape[-1])).view(*shape[:-1], self.out_features)

    def _forward_2d(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.matmuls) == 1:
            y = self.matmuls[0](x)
        else:
            y = torch.cat([matmul(x) for matmul in self.matmuls], dim=-1)
        return self._biased(y)

    def _biased(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    @property
    def _native(self) -> list[native.NativeWeight | None]:
        """Each part's native weight where its matmul is the native GEMV of the input as given."""
        return [m.native if isinstance(m, NativeLinear) else None for m in self.matmuls]

    def native_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this layer's output, for a fused gate/up projection (rows [0, I) gate,
        [I, 2I) up), in one native call where the layer is one native weight without bias or input
        permutation and x takes the native GEMV (as `forward` would); else None."""
        return None if self._silu_gemv is None else self._silu_gemv.silu_and_mul(x)

    def native_gemv_weight(self) -> native.NativeWeight | None:
        """The layer's one native weight when `forward` is exactly its GEMV (no bias, no input permutation,
        one part), for callers that fuse it with other native ops (ops.decode_layer); else None."""
        parts = self.native_gemv_parts()
        return parts[0] if parts is not None and parts[1] is None else None

    def native_gemv_parts(self) -> tuple[native.NativeWeight, torch.Tensor | None] | None:
        """(native weight, float32 bias or None) when `forward` is exactly that GEMV plus the bias (one part,
        no input permutation); else None."""
        nat = self._native
        if len(nat) != 1 or nat[0] is None:
            return None
        if self.bias is not None and self.bias.dtype != torch.float32:
            return None
        return nat[0], None if self.bias is None else self.bias.detach()

    def cpu_dense_weight(self) -> torch.Tensor | None:
        """The whole weight when it is one part kept as a dense CPU copy, else None."""
        if len(self.matmuls) == 1 and isinstance(self.matmuls[0], DenseInt8Linear):
            return self.matmuls[0].dense
        return None

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor the weight occupies (codes, scales, zeros, dense parts, the implementations' own
        layouts), for memory accounting."""
        tensors = [t for p in self.parts for t in (p.tensors() if isinstance(p, QuantizedWeight) else [p])]
        return tensors + [t for m in self.matmuls for t in m.tensors()]


def _beside_int8(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """The parts with int5 ones widened to int8 where another part is int8 (GGUF Q5_0 q/k beside a Q8_0
    v), so that they still fuse into one weight: one GEMV, and one native weight for the decode layer."""
    if not any(p.kind == "int8" for p in parts):
        return parts
    return [widen_int5(p) for p in parts]


def _device(p: QuantizedWeight | torch.Tensor) -> torch.device:
    return (p.qweight if isinstance(p, QuantizedWeight) else p).device


class QuantEmbedding(nn.Module):
    """Token embedding that dequantizes only the rows it looks up; with tied weights it also serves
    as the LM head through `attend`, and finds greedy tokens through `argmax`."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, tied: bool) -> None:
        super().__init__()
        weight = registry.kept_form(registry.target(weight.qweight.device, dtype), weight)
        self.weight_q = weight
        self.dtype = dtype
        self.head = QuantLinear([weight], None, dtype) if tied else None
        dense = self.head.cpu_dense_weight() if self.head is not None else None
        self.screen = ScreenedArgmax(dense) if dense is not None and dense.dtype == torch.float32 else None
        # A tied head's native weight holds the embedding's values too: the lookup is one native call
        # (ops.dequantize_rows) instead of ~10 PyTorch ops, ~0.1 ms of a CPU decode step (2026-12-07).
        self.native_rows = self.head.native_gemv_weight() if self.head is not None and dtype == torch.float32 else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.native_rows is not None and ids.dim() == 1 and ids.dtype == torch.int64 and ids.is_contiguous():
            return native.dequantize_rows(self.native_rows, ids)
        w = self.weight_q
        scale_rows = ids // w.block_rows if w.block_rows > 1 else ids
        rows = QuantizedWeight(
            w.kind,
            w.qweight[ids],
            w.scales[scale_rows],
            None if w.zeros is None else w.zeros[scale_rows],
            w.group_size,
            w.in_features,
            runs=w.runs,
        )
        return dequantize(rows, self.dtype)

    def attend(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.head is not None, "only a tied embedding serves as the LM head"
        return self.head(hidden)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The token `attend` scores highest per row, without every float32 logit where a screen exists."""
        if self.screen is not None:
            return self.screen(hidden)
        logits = self.attend(hidden)
        return native.rows_argmax(logits)

    def weight_tensors(self) -> list[torch.Tensor]:
        head = self.head.weight_tensors() if self.head is not None else []
        return self.weight_q.tensors() + head + (self.screen.tensors() if self.screen is not None else [])


def quantize_module(module: nn.Linear | nn.Embedding, method: str, dtype: torch.dtype, tied: bool) -> nn.Module:
    """The quantized replacement of a dense nn.Linear or nn.Embedding (its float weight is dropped);
    a `tied` embedding also serves as the LM head. `method` is a `--quantization` method."""
    if isinstance(module, nn.Embedding):
        return QuantEmbedding(quantize(module.weight.data, method), dtype, tied)
    return QuantLinear([quantize(module.weight.data, method)], module.bias, dtype)


def fp8_input_layout(linear: nn.Module, rows: int) -> Fp8Layout | None:
    """QuantLinear.fp8_layout; None for a dense nn.Linear."""
    return linear.fp8_layout(rows) if isinstance(linear, QuantLinear) else None
