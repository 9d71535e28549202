"""The kernel registry: which implementation each op of a layer gets, asked once by the layer when it is
built or its weights or KV cache are set. Each table lists an op's implementations in order of
preference; the first whose `can_implement(target, ...)` holds is chosen. Adding a kernel is its class
and a line in its op's table.

`FORCE_TRITON` chooses the Triton kernels for CPU tensors too, run through Triton's interpreter
(TRITON_INTERPRET=1), so the whole GPU code path can be tested end to end without a GPU. It is read
when a choice is made: layers built after it is set take the kernels.

`FUSE_FP8_QUANT` (EMBER_FUSE_FP8_QUANT=0 turns it off, for before/after benchmarks and tests) lets
RMSNorm and SwiGLU write their outputs quantized for the fp8 linears that read them (`fp8_norm_impl`,
`fp8_activation_impl`); off, those linears quantize their input themselves.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from ember.cpu_native import ops as native
from ember.ops import (
    activation,
    attention,
    gated_delta,
    linear,
    linear_cpu,
    linear_gpu,
    linear_native,
    lora,
    mla,
    moe,
    norm,
    rotary,
)
from ember.ops.decode_layer import NativeDecodeLayers
from ember.ops.target import Target
from ember.ops.unfused import Unfused
from ember.quant.formats import Fp8Activation, QuantizedWeight, packed, widen_int5

FORCE_TRITON = False
FUSE_FP8_QUANT = os.environ.get("EMBER_FUSE_FP8_QUANT", "1") != "0"

Built = TypeVar("Built", covariant=True)


class Implementation(Protocol[Built]):
    """An implementation as its op's table lists it: the class, which states what it can run
    (`can_implement(target, ...)`, a staticmethod, from the facts the layer knows) and, called with the
    layer's arguments, builds the `Built` the layer keeps and calls. The facts and the arguments are each
    op's own; the table's annotation says what its implementations build."""

    def can_implement(self, *facts: Any, **kwargs: Any) -> bool: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Built: ...


class LinearImplementation(Implementation[linear.LinearImpl], Protocol):
    permutes_input: bool  # its layout keeps an act-order weight's columns in that order (see linear.Permuted)


Impl = TypeVar("Impl", bound=Implementation[Any])  # a table's element type, which `_first` returns as it is

# The gated activation over the fused gate/up projection (ember/ops/activation.py): (proj, x) -> act(gate) * up
Activation = Callable[[Any, torch.Tensor | Fp8Activation], torch.Tensor]

LINEAR: tuple[LinearImplementation, ...] = (
    linear.DenseLinear,
    linear_gpu.TritonPackedLinear,
    linear_gpu.TritonQuantLinear,
    linear_gpu.TritonFp8ChannelLinear,
    linear_gpu.TritonFp8BlockLinear,
    linear_native.NativeLinear,
    *linear_cpu.TORCH_CPU_LINEARS,
    linear.DequantizeLinear,
)
ATTENTION: tuple[Implementation[attention.TorchAttention | attention.TritonAttention], ...] = (
    attention.TritonAttention,
    attention.NativeDecodeAttention,
    attention.TorchAttention,
)
# DeepSeek's multi-head latent attention over its latent cache (ember/ops/mla.py)
MLA: tuple[Implementation[mla.TorchMLA], ...] = (mla.TritonMLA, mla.TorchMLA)
NORM: tuple[Implementation[norm.NormImpl], ...] = (norm.TritonRMSNorm, norm.TorchRMSNorm, norm.TorchGemmaRMSNorm)
# wrapping the PyTorch norm, which runs for the rows they do not take
NATIVE_NORM: tuple[Implementation[norm.NormImpl], ...] = (norm.NativeRMSNorm,)
ROTARY: tuple[Implementation[rotary.TorchRotary | rotary.TritonRotary], ...] = (
    rotary.TritonRotary,
    rotary.TorchFullRotary,
    rotary.TorchRotary,
)
ROTARY_STORE: tuple[Implementation[rotary.TritonRotaryStore | rotary.NativeRotaryStore | Unfused], ...] = (
    rotary.TritonRotaryStore,
    rotary.NativeRotaryStore,
    Unfused,
)
ACTIVATION: tuple[Implementation[Activation], ...] = (
    activation.TorchGeluTanhAndMul,
    activation.TritonSiluAndMul,
    activation.NativeSiluAndMul,
    activation.TorchSiluAndMul,
)
# the same ops writing their outputs quantized for the fp8 linear that reads them (ember/quant/formats.py Fp8Layout)
FP8_NORM: tuple[Implementation[norm.TritonFp8RMSNorm], ...] = (norm.TritonFp8RMSNorm,)
FP8_ACTIVATION: tuple[Implementation[activation.TritonFp8SiluAndMul], ...] = (activation.TritonFp8SiluAndMul,)
MOE: tuple[Implementation[moe.TritonMoe | moe.TorchMoe], ...] = (moe.TritonMoe, moe.TorchMoe)
LORA: tuple[Implementation[lora.TritonLoRA | lora.TorchLoRA], ...] = (lora.TritonLoRA, lora.NativeLoRA, lora.TorchLoRA)
DECODE_LAYER: tuple[Implementation[NativeDecodeLayers | Unfused], ...] = (NativeDecodeLayers, Unfused)
GATED_DELTA_DECODE: tuple[Implementation[gated_delta.TritonRecurrent | gated_delta.TorchRecurrent], ...] = (
    gated_delta.TritonRecurrent,
    gated_delta.TorchRecurrent,
)
GATED_DELTA_PREFILL: tuple[Implementation[gated_delta.TritonPrefill | gated_delta.TorchChunkedPrefill], ...] = (
    gated_delta.TritonPrefill,
    gated_delta.TorchChunkedPrefill,
)


def target(device: torch.device, dtype: torch.dtype) -> Target:
    """The facts of a layer on `device` computing in `dtype`, the switch included."""
    triton = device.type == "cuda" or FORCE_TRITON
    return Target(device, dtype, triton, device.type == "cpu" and not triton and native.available())


def _first(table: tuple[Impl, ...], *facts: Any) -> Impl:
    """The table's first implementation that can run what `facts` describe."""
    return next(cls for cls in table if cls.can_implement(*facts))


def _fp8_fused(table: tuple[Impl, ...], *facts: Any) -> Impl | None:
    """`_first` for an op's fp8-output form, or None where none runs or FUSE_FP8_QUANT is off."""
    return next((cls for cls in table if FUSE_FP8_QUANT and cls.can_implement(*facts)), None)


def kept_form(t: Target, w: QuantizedWeight) -> QuantizedWeight:
    """`w` as a layer on `t` keeps it: int5 codes (GGUF Q5_0's blocks, as read) and int4 runs (GGUF Q4_1's)
    where the native CPU kernels run them; elsewhere int8 and Ember's int4 packing, which the other kernels
    take (DequantizeLinear would take int5 too, and unpack it at every call)."""
    if linear_native.NativeLinear.can_implement(t, w):
        return w
    return packed(widen_int5(w))


def linear_impl(t: Target, w: QuantizedWeight | torch.Tensor, dtype: torch.dtype) -> linear.LinearImpl:
    """One part of a QuantLinear: its implementation, built (the weight laid out) once."""
    w = kept_form(t, w) if isinstance(w, QuantizedWeight) else w
    cls = _first(LINEAR, t, w)
    impl = cls(w, dtype)
    if cls.permutes_input and isinstance(w, QuantizedWeight) and w.in_perm is not None:
        return linear.Permuted(impl, w.in_perm)
    return impl


def attention_impl(t: Target, shape: attention.AttentionShape) -> attention.TorchAttention | attention.TritonAttention:
    return _first(ATTENTION, t, shape)()


def mla_impl(t: Target, shape: mla.MlaShape) -> mla.TorchMLA:
    return _first(MLA, t, shape)(shape)


def norm_impl(t: Target, style: str) -> norm.NormImpl:
    """RMSNorm in `style` ("llama": rounded before scaling, or "gemma": after)."""
    impl = _first(NORM, t, style)()
    wrapper = next((cls for cls in NATIVE_NORM if cls.can_implement(t, style)), None)
    return impl if wrapper is None else wrapper(impl)


def fp8_norm_impl(t: Target, style: str) -> norm.TritonFp8RMSNorm | None:
    """RMSNorm whose output comes quantized for the fp8 linear reading it; None: the linear quantizes it."""
    cls = _fp8_fused(FP8_NORM, t, style)
    return None if cls is None else cls()


def rotary_impl(t: Target, full: bool) -> rotary.TorchRotary | rotary.TritonRotary:
    """`full`: every channel of a head is rotated."""
    return _first(ROTARY, t, full)()


def rotary_store_impl(
    t: Target,
    cache_dtype: torch.dtype,
    tables: rotary.Tables | None,
    qk_norms: rotary.QKNorms | None,
    num_heads: int,
    head_dim: int,
) -> rotary.TritonRotaryStore | rotary.NativeRotaryStore | Unfused:
    """Rotary (after the QK norm where `qk_norms`) and the KV store fused, where a kernel does both."""
    cls = _first(ROTARY_STORE, t, cache_dtype, tables, qk_norms)
    return cls(tables, num_heads, head_dim, qk_norms)


def activation_impl(t: Target, act: str, proj: Any) -> Activation:
    """The gated activation `act` over the fused gate/up projection `proj` as it is after loading."""
    return _first(ACTIVATION, t, act, proj)()


def fp8_activation_impl(t: Target, act: str) -> activation.TritonFp8SiluAndMul | None:
    """The gated activation `act` with its output quantized for the fp8 down projection; None: the down
    projection quantizes it."""
    cls = _fp8_fused(FP8_ACTIVATION, t, act)
    return None if cls is None else cls()


def moe_impl(t: Target) -> moe.TritonMoe | moe.TorchMoe:
    return _first(MOE, t)()


def gated_delta_decode_impl(t: Target) -> gated_delta.TritonRecurrent | gated_delta.TorchRecurrent:
    """One decode token of the gated delta rule per sequence, over the linear-attention state pool."""
    return _first(GATED_DELTA_DECODE, t)()


def gated_delta_prefill_impl(t: Target) -> gated_delta.TritonPrefill | gated_delta.TorchChunkedPrefill:
    """The step's prompt chunks of the gated delta rule, over the linear-attention state pool."""
    return _first(GATED_DELTA_PREFILL, t)()


def lora_impl(t: Target) -> lora.TritonLoRA | lora.TorchLoRA:
    """The per-row adapter delta added to a projection's output (ember/ops/lora.py)."""
    return _first(LORA, t)()


def decode_layer_impl(t: Target, layer: Any) -> NativeDecodeLayers | Unfused:
    """A decoder layer's whole decode step, as its modules are once loaded."""
    return _first(DECODE_LAYER, t, layer)(layer)


def decode_layers_impl(t: Target, layers: list[Any]) -> NativeDecodeLayers | Unfused:
    """The decode step of all of a model's decoder layers in one call, as their modules are once loaded."""
    return _first(DECODE_LAYER, t, *layers)(*layers)
