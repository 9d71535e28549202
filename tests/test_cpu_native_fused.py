"""The fused decode-layer kernels of ember/cpu_native (residual add + RMSNorm, rotary + KV store,
gate/up GEMV + SiLU) against float64 references and the PyTorch ops they replace, in the AVX-512
build and the plain-C one; and end to end, the fused path against the unfused native path and the
PyTorch path."""

from __future__ import annotations

import math

import pytest
import test_cpu_native as base
import torch
import torch.nn.functional as F
from conftest import default_gguf_path, make_checkpoint

from ember import LLM
from ember.cpu_native import ops
from ember.model import llama
from ember.model.layers import RotaryEmbedding
from ember.model.linear import QuantLinear
from ember.ops import linear_native as linear
from ember.ops import norm as layers
from ember.quant.formats import dequantize

pytestmark = base.pytestmark
# test_cpu_native's fixtures: the kernels on (autouse), and each kernel test run on both builds
native_on, plain_c, kernels = base.native_on, base.plain_c, base.kernels
_assert_same, _generate, _weight = base._assert_same, base._generate, base._weight


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(("m", "n"), [(1, 576), (5, 40), (300, 576)])  # 300 rows: the parallel loop
def test_add_rms_norm_matches_float64_reference(kernels, with_residual: bool, m: int, n: int) -> None:
    gen = torch.Generator().manual_seed(m + n)
    x, residual, w = (
        torch.randn(m, n, generator=gen) * 3,
        torch.randn(m, n, generator=gen),
        torch.rand(n, generator=gen),
    )
    eps = 1e-5
    if with_residual:
        out, total = ops.add_rms_norm(x, residual, w, eps)
        assert torch.equal(total, x + residual)  # the one float32 rounding the PyTorch path makes
    else:
        out, total = ops.rms_norm(x, w, eps), x
    t = total.double()
    ref = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, F.rms_norm(total, (n,), w, eps), atol=1e-5, rtol=1e-5)


# d 40: half a head is not a whole vector; 256 tokens: the parallel loop
@pytest.mark.parametrize(("d", "t"), [(32, 5), (40, 5), (32, 256)])
def test_rotary_store_equals_the_pytorch_ops(kernels, d: int, t: int) -> None:
    """GQA (6 query heads, 2 KV heads), tokens with scattered slots, some -1 (padding: nothing written),
    qkv rows strided: the rotation is RotaryEmbedding's CPU ops bit for bit (and the float64 formula
    within rounding), the caches `store_kv`'s writes exactly."""
    gen = torch.Generator().manual_seed(d + t)
    hq, hk = 6, 2
    rotary = RotaryEmbedding(d, 64, 10000.0, None)
    qkv = torch.randn(t, (hq + 2 * hk) * d + 8, generator=gen)[:, : (hq + 2 * hk) * d]
    positions = torch.randint(0, 64, (t,), generator=gen)
    positions[:2] = torch.tensor([0, 63])
    slots = torch.randperm(80 * 4, generator=gen)[:t]
    slots[2::3] = -1
    k_cache, v_cache = torch.randn(80, 4, hk, d, generator=gen), torch.randn(80, 4, hk, d, generator=gen)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    heads = qkv.view(t, hq + 2 * hk, d)
    q_ref, k_ref = rotary.rotate_qk(positions, heads[:, : hq + hk], hq)
    v_ref = heads[:, hq + hk :].clone()
    keep = slots >= 0
    k_expected.view(-1, hk, d)[slots[keep]] = k_ref[keep]
    v_expected.view(-1, hk, d)[slots[keep]] = v_ref[keep]
    x64 = heads[:, : hq + hk].double()
    rotated64 = (
        x64 * rotary.cos[positions, None].double() + x64.roll(d // 2, -1) * rotary.sin_signed[positions, None].double()
    )

    ops.rotary_store(qkv, positions, rotary.cos, rotary.sin_signed, k_cache, v_cache, slots, hq)
    assert torch.equal(heads[:, :hq], q_ref) and torch.equal(heads[:, hq : hq + hk], k_ref)
    assert torch.equal(heads[:, hq + hk :], v_ref)
    torch.testing.assert_close(heads[:, : hq + hk].double(), rotated64, atol=1e-6, rtol=1e-6)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


def test_rotary_store_rejects_positions_and_slots_out_of_range() -> None:
    rotary = RotaryEmbedding(16, 8, 10000.0, None)
    cache = torch.zeros(2, 4, 1, 16)
    qkv = torch.randn(1, 3 * 16)
    for positions, slots, what in (([8], [0], "position 8"), ([0], [8], "slot 8"), ([-1], [0], "position -1")):
        with pytest.raises(IndexError, match=what):
            ops.rotary_store(
                qkv,
                torch.tensor(positions),
                rotary.cos,
                rotary.sin_signed,
                cache,
                cache.clone(),
                torch.tensor(slots),
                1,
            )
    assert not cache.any()
    with pytest.raises(ValueError, match="qkv must be"):
        ops.rotary_store(
            torch.randn(1, 40),
            torch.tensor([0]),
            rotary.cos,
            rotary.sin_signed,
            cache,
            cache.clone(),
            torch.tensor([0]),
            1,
        )


@pytest.mark.parametrize(
    ("kind", "group", "half"),
    [("int4", 32, True), ("int4", 64, False), ("int8", 16, False), ("int8", None, False), ("int5", 32, True)],
)
def test_matmul_silu_matches_float64_reference(kernels, kind: str, group: int | None, half: bool) -> None:
    """I = 70 (not a whole number of vectors); M from one row to past a tile of 8. int5: GGUF Q5_0's
    codes, kept in 5 bits (no zeros)."""
    size, k = 70, 256
    w = _weight(kind, 2 * size, k, group or k, kind != "int5", half=half)
    nat = ops.native_weight(w)
    assert nat.kind == kind
    dense = dequantize(w).double()
    for m in (1, 3, 9):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = x.double() @ dense.T
        gate, up = y[:, :size], y[:, size:]
        ref = F.silu(gate) * up
        # the GEMV's float32 summation error, carried through silu (slope within [-0.1, 1.1]) and the product
        err = 2e-6 * math.sqrt(k) * (x.double().abs() @ dense.abs().T)
        bound = 1.1 * err[:, :size] * up.abs() + gate.abs() * err[:, size:] + 1e-6 * ref.abs() + 1e-6
        got = ops.matmul_silu(x, nat).double()
        assert (got - ref).abs().le(bound).all(), (got - ref).abs().max()


def test_quant_linear_fuses_silu_on_its_native_gemvs(monkeypatch) -> None:
    monkeypatch.setenv("EMBER_CPU_NATIVE", "1")
    layer = QuantLinear([_weight("int4", 64, 128, 32, False)], None, torch.float32)
    x = torch.randn(3, 128)
    gate, up = layer(x).split(32, dim=-1)
    torch.testing.assert_close(layer.native_silu_and_mul(x), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    assert layer.native_silu_and_mul(x.double()) is None
    rows = torch.randn(int(linear.native_expand_min_rows(layer._native[0])), 128)
    assert layer.native_silu_and_mul(rows) is None


def _float32_matmuls(monkeypatch) -> None:
    """int4 in float32 (CPU_INT4_BF16) for these token-for-token comparisons: in bf16 arithmetic each
    matmul output is rounded to bf16, which turns the fused and unfused SiLU's last-bit differences into
    bf16 rounding ones."""
    monkeypatch.setattr(linear, "CPU_INT4_BF16", False)


def _per_layer(monkeypatch) -> None:
    """Decode steps one ops.decode_layers call a layer, not one for the whole model."""
    monkeypatch.setattr(llama.DecoderModel, "_native_decode", lambda *args: None)


def _layer_by_layer(monkeypatch) -> None:
    """Decode steps through the layers' modules, each making its own native calls, not ops.decode_layers."""
    _per_layer(monkeypatch)
    monkeypatch.setattr(llama.DecoderLayer, "_native_decode", lambda *args: None)


def _unfused(monkeypatch) -> None:
    """The native GEMVs and attention without the fused ops: today's PyTorch ops between them."""
    _layer_by_layer(monkeypatch)
    monkeypatch.setattr(layers, "_native_norm_fits", lambda *args: False)
    monkeypatch.setattr(llama.Attention, "_fused_rotary_store", lambda *args: None)
    monkeypatch.setattr(QuantLinear, "native_silu_and_mul", lambda *args: None)


def _counting(monkeypatch) -> dict[str, int]:
    """Calls of each fused op, so a test knows the fused path ran."""
    calls: dict[str, int] = {}

    def counting(name: str):
        fn = getattr(ops, name)

        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted

    for name in ("add_rms_norm", "rms_norm", "rotary_store", "matmul_silu", "decode_layers"):
        monkeypatch.setattr(ops, name, counting(name))
    return calls


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]


def test_default_model_fused_equals_unfused_and_pytorch(monkeypatch) -> None:
    """The default model's fused path against its unfused native path (the Q4_1/Q8_0 file, int4 matmuls
    in float32), batched and alone; and, loaded dense (quantization "none": fused norms, rotary and stores
    around PyTorch
    matmuls), against the PyTorch path."""
    kwargs = {"kv_cache_memory": 0.05, "max_model_len": 256, "engine_process": False}
    _float32_matmuls(monkeypatch)
    calls = _counting(monkeypatch)
    fused = LLM(default_gguf_path(), **kwargs)
    got = _generate(fused, PROMPTS, 24) + _generate(fused, PROMPTS[1:2], 24)
    dense = _generate(LLM(default_gguf_path(), quantization="none", **kwargs), PROMPTS, 16)
    assert {"add_rms_norm", "rms_norm", "rotary_store", "matmul_silu"} <= calls.keys()
    with monkeypatch.context() as m:
        _unfused(m)
        unfused = LLM(default_gguf_path(), **kwargs)
        _assert_same(got, _generate(unfused, PROMPTS, 24) + _generate(unfused, PROMPTS[1:2], 24), 2e-3)
    monkeypatch.setenv("EMBER_CPU_NATIVE", "0")
    _assert_same(dense, _generate(LLM(default_gguf_path(), quantization="none", **kwargs), PROMPTS, 16), 2e-3)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_tiny_quantized_llama_fused_equals_unfused_and_pytorch(tmp_path, monkeypatch, method: str) -> None:
    """Load-time int4/int8 on a tiny random Llama (GQA): fused against unfused native, batched and alone,
    40 tokens; against the PyTorch path (bf16 activations in its int4/int8 kernels) the first 12 tokens,
    as tests/test_cpu_native.py holds the unfused path to it."""
    path = make_checkpoint(tmp_path / "llama", "llama")
    prompts = ["hello world", "the quick brown fox jumps", "a b c d e f g h i j k l m n o p q r s"]
    kwargs = {"quantization": method, "kv_cache_memory": 0.02, "max_model_len": 256, "engine_process": False}
    _float32_matmuls(monkeypatch)
    calls = _counting(monkeypatch)
    fused = LLM(str(path), **kwargs)
    got = _generate(fused, prompts, 40) + _generate(fused, prompts[2:], 40)
    assert {"add_rms_norm", "rotary_store", "matmul_silu"} <= calls.keys()
    with monkeypatch.context() as m:
        _unfused(m)
        unfused = LLM(str(path), **kwargs)
        _assert_same(got, _generate(unfused, prompts, 40) + _generate(unfused, prompts[2:], 40), 1e-3)
    monkeypatch.setenv("EMBER_CPU_NATIVE", "0")
    fallback = _generate(LLM(str(path), **kwargs), prompts, 12)
    _assert_same(fallback, [(tokens[:12], logprobs[:12]) for tokens, logprobs in got[:3]], 5e-2)


@pytest.mark.parametrize(
    ("arch", "method"),
    [
        ("default", None),
        ("llama", "int4"),
        ("llama", "int8"),
        ("mistral-sw", "int4"),
        ("phi3-sw", "int8"),
        ("qwen2", "int4"),
    ],
)
def test_decode_layer_equals_the_layers_modules_bit_for_bit(
    tmp_path, monkeypatch, arch: str, method: str | None
) -> None:
    """ops.decode_layers runs a decode step's layers in one call (the whole model's, or, where the model's
    call is off, a layer's) with the kernels their modules call one by one, in the same order and threads:
    the same tokens and logprobs exactly, batched and alone; for the
    default model's Q4_1/Q8_0 file (int4 in bf16 arithmetic where the CPU has AVX512_BF16) and load-time
    int4/int8 on tiny random Llama-family models (GQA; 8-key sliding windows that the prompts outgrow;
    Qwen2's QKV bias)."""
    if arch == "default":
        path, kwargs, prompts = default_gguf_path(), {"kv_cache_memory": 0.05}, PROMPTS
    else:
        path = str(make_checkpoint(tmp_path / arch, arch))
        kwargs = {"quantization": method, "kv_cache_memory": 0.02}
        prompts = ["hello world", "the quick brown fox jumps", "a b c d e f g h i j k l m n o p q r s"]
    kwargs |= {"max_model_len": 256, "engine_process": False}
    calls = _counting(monkeypatch)
    fused = LLM(path, **kwargs)
    got = _generate(fused, prompts, 24) + _generate(fused, prompts[1:2], 24)
    assert calls.get("decode_layers", 0) >= 23  # every decode step
    with monkeypatch.context() as m:
        _per_layer(m)
        per_layer = LLM(path, **kwargs)
        before = calls["decode_layers"]
        assert got == _generate(per_layer, prompts, 24) + _generate(per_layer, prompts[1:2], 24)
        assert calls["decode_layers"] - before >= 2 * 23  # every layer of every decode step, two layers at least
    with monkeypatch.context() as m:
        _layer_by_layer(m)
        modules = LLM(path, **kwargs)
        assert got == _generate(modules, prompts, 24) + _generate(modules, prompts[1:2], 24)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_decode_layer_with_qwen3_qk_norm(tmp_path, monkeypatch, method: str) -> None:
    """Qwen3's per-head QK RMSNorm inside ops.decode_layers: the kernels' RMSNorm where the modules use
    PyTorch's, so the float32 sums differ in order only: the same tokens, logprobs within 1e-4 (int4 in
    float32 here: in bf16, those last-bit differences would become bf16 roundings of the matmul outputs)."""
    _float32_matmuls(monkeypatch)
    path = str(make_checkpoint(tmp_path / "qwen3", "qwen3"))
    prompts = ["hello world", "the quick brown fox jumps", "a b c d e f g h i j k l m n o p q r s"]
    kwargs = {"quantization": method, "kv_cache_memory": 0.02, "max_model_len": 256, "engine_process": False}
    calls = _counting(monkeypatch)
    fused = LLM(path, **kwargs)
    got = _generate(fused, prompts, 24) + _generate(fused, prompts[1:2], 24)
    assert calls.get("decode_layers", 0) >= 23
    with monkeypatch.context() as m:
        _layer_by_layer(m)
        modules = LLM(path, **kwargs)
        _assert_same(got, _generate(modules, prompts, 24) + _generate(modules, prompts[1:2], 24), 1e-4)
