"""The kernel registry (ember/ops/registry.py): what each layer gets for the facts known when it is built,
FORCE_TRITON read when the choice is made, and the LM head's quantization method."""

from __future__ import annotations

import pytest
import torch

from ember.cpu_native import ops as native
from ember.model.layers import GemmaRMSNorm, RMSNorm
from ember.model.linear import QuantLinear
from ember.ops import linear_cpu, linear_gpu, linear_native, norm, registry, rotary
from ember.ops.linear import DenseLinear, Permuted
from ember.ops.unfused import Unfused
from ember.quant.quantize import method_for, quantize_int4, quantize_int8


def test_linear_parts_choose_by_format_and_device(monkeypatch) -> None:
    monkeypatch.setenv("EMBER_CPU_NATIVE", "0")
    w8, w4 = quantize_int8(torch.randn(32, 64)), quantize_int4(torch.randn(32, 64), group_size=32)
    layer = QuantLinear([w8, w4, torch.randn(16, 64)], None, torch.float32)
    assert [type(m) for m in layer.matmuls] == [linear_cpu.Int8PackLinear, linear_cpu.Int4PackLinear, DenseLinear]
    w4.in_perm = torch.randperm(64)
    assert isinstance(QuantLinear([w4], None, torch.float32).matmuls[0], Permuted)
    monkeypatch.setattr(registry, "FORCE_TRITON", True)
    assert type(QuantLinear([w8], None, torch.float32).matmuls[0]) is linear_gpu.TritonQuantLinear


def test_native_kernels_are_chosen_where_they_are_available(monkeypatch) -> None:
    if not native.available():
        pytest.skip("the native CPU kernels are not built here")
    w4 = quantize_int4(torch.randn(32, 64), group_size=32)
    assert type(QuantLinear([w4], None, torch.float32).matmuls[0]) is linear_native.NativeLinear
    assert isinstance(RMSNorm(8, 1e-6)._impl, norm.NativeRMSNorm)
    monkeypatch.setenv("EMBER_CPU_NATIVE", "0")  # read at the next choice, as at the next model load
    assert type(QuantLinear([w4], None, torch.float32).matmuls[0]) is linear_cpu.Int4PackLinear
    assert type(RMSNorm(8, 1e-6)._impl) is norm.TorchRMSNorm


def test_force_triton_applies_to_layers_built_after_it(monkeypatch) -> None:
    monkeypatch.setenv("EMBER_CPU_NATIVE", "0")
    before = GemmaRMSNorm(8, 1e-6)
    monkeypatch.setattr(registry, "FORCE_TRITON", True)
    assert type(before._impl) is norm.TorchGemmaRMSNorm
    assert type(GemmaRMSNorm(8, 1e-6)._impl) is norm.TritonRMSNorm


def test_int4_keeps_the_lm_head_at_int8() -> None:
    assert method_for("int4", lm_head=True) == "int8" and method_for("int4", lm_head=False) == "int4"
    assert all(method_for(m, lm_head=True) == m for m in ("int8", "fp8", "ptpc_fp8"))


def test_rotary_store_fuses_on_triton_for_plain_qk_norms_and_model_dtype_caches(monkeypatch) -> None:
    monkeypatch.setattr(registry, "FORCE_TRITON", True)
    t = registry.target(torch.device("cpu"), torch.bfloat16)
    tables = (torch.ones(4, 8), torch.ones(4, 8))
    plain = (RMSNorm(8, 1e-6), RMSNorm(8, 1e-6))

    def chosen(cache_dtype: torch.dtype, qk_norms, full: bool = True) -> type:
        return type(registry.rotary_store_impl(t, cache_dtype, tables if full else None, qk_norms, 2, 8))

    assert chosen(torch.bfloat16, None) is rotary.TritonRotaryStore
    assert chosen(torch.bfloat16, plain) is rotary.TritonRotaryStore
    assert chosen(torch.float8_e4m3fn, None) is Unfused  # fp8 caches: the store kernel quantizes
    assert chosen(torch.bfloat16, None, full=False) is Unfused  # partial rotary or a scaled cache
    assert chosen(torch.bfloat16, (GemmaRMSNorm(8, 1e-6), GemmaRMSNorm(8, 1e-6))) is Unfused
    assert chosen(torch.bfloat16, (RMSNorm(8, 1e-6), RMSNorm(8, 1e-5))) is Unfused
