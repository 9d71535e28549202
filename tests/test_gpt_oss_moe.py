"""gpt-oss's experts: biases on gate/up and down, and the clamped SwiGLU
(clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), in the fused Triton MoE kernels
(through the interpreter) and in the engine's PyTorch expert path, against a float64 per-token reference
written here from transformers' GptOssExperts. The limit is set low so the clamps bite on O(1) values.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_kernels import BY_TOKEN_TILES, FUSED_TILES, SMALL_TILES, TOL, _experts, _gen, _randn, _routing

from ember.kernels.fused_moe import fused_moe, fused_moe_ref
from ember.model.moe import FusedExperts
from ember.model.sharding import ShardLayout
from ember.quant.experts import QuantizedExperts, dequantize_experts

SWIGLU = (1.702, 0.8)  # (alpha, limit)


def per_token_reference(x, w13, w2, b13, b2, weights, ids, swiglu=SWIGLU) -> torch.Tensor:
    """transformers' GptOssExperts token by token in float64 (gate rows then up rows of w13)."""
    alpha, limit = swiglu
    dense13 = (dequantize_experts(w13) if isinstance(w13, QuantizedExperts) else w13).double().cpu()
    dense2 = (dequantize_experts(w2) if isinstance(w2, QuantizedExperts) else w2).double().cpu()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (dense13[e] @ x[t].double().cpu() + b13[e].double().cpu()).chunk(2)
            gate = gate.clamp(max=limit)
            glu = gate * torch.sigmoid(gate * alpha)
            out[t] += w * (dense2[e] @ ((up.clamp(-limit, limit) + 1) * glu) + b2[e].double().cpu())
    return out


@pytest.mark.parametrize(
    "kind,dtype,m,e,k,h,inter,config",
    [
        (torch.float32, torch.float32, 1, 4, 2, 64, 32, None),
        (torch.float32, torch.float32, 1, 6, 3, 40, 32, BY_TOKEN_TILES),  # down's bias in down_by_token
        (torch.float32, torch.float32, 9, 6, 2, 40, 24, SMALL_TILES),
        (torch.float32, torch.float32, 3, 6, 2, 40, 48, FUSED_TILES),  # both biases in the one-kernel MLP
        ("int8-g16", torch.bfloat16, 2, 5, 2, 64, 48, FUSED_TILES),
        (torch.bfloat16, torch.bfloat16, 5, 8, 3, 64, 32, None),
        ("int8-g16", torch.float32, 7, 5, 2, 64, 48, SMALL_TILES),  # GGUF/HF MXFP4 experts load as int8 g32
    ],
)
def test_fused_moe_swiglu_with_biases(kind, dtype, m, e, k, h, inter, config):
    gen = _gen("gpt-oss", kind, dtype, m, e, k)
    w13, w2 = _experts(kind, e, h, inter, gen)
    b13, b2 = _randn(e, 2 * inter, gen=gen, dtype=dtype), _randn(e, h, gen=gen, scale=0.5, dtype=dtype)
    weights, ids = _routing(m, e, k, gen)
    hidden = _randn(m, h, gen=gen, scale=2.0, dtype=dtype)
    out = fused_moe(hidden, w13, w2, weights, ids, config=config, b13=b13, b2=b2, swiglu=SWIGLU)
    ref = per_token_reference(hidden, w13, w2, b13, b2, weights, ids)
    torch.testing.assert_close(out.double().cpu(), ref, **TOL[dtype])
    torch.testing.assert_close(
        fused_moe_ref(hidden.float(), w13, w2, weights, ids, b13=b13, b2=b2, swiglu=SWIGLU).double().cpu(),
        ref,
        **TOL[dtype],
    )
    # the clamps bite: without them the result moves
    unclamped = per_token_reference(hidden, w13, w2, b13, b2, weights, ids, swiglu=(SWIGLU[0], 1e9))
    assert not torch.allclose(unclamped, ref, **TOL[dtype])


def _layout(inter: int, rank: int = 0, size: int = 1) -> ShardLayout:
    return ShardLayout(
        rank=rank,
        size=size,
        head_dim=16,
        num_heads=4,
        num_kv_heads=2,
        kv_head_start=0,
        intermediate_size=inter,
        vocab_size=64,
        vocab_per_rank=64,
        moe_intermediate_size=inter // size,
    )


def _load(module: FusedExperts, tensors: dict[str, torch.Tensor]) -> FusedExperts:
    for name, t in tensors.items():
        module.load(name, t, "ckpt")
    module.finish_loading("ckpt")
    return module


def test_torch_expert_path_and_tensor_parallel_halves():
    """The PyTorch path (on the CPU, where the engine takes it) with biases and the clamped SwiGLU equals
    the per-token reference; two ranks' halves (rank 1 holding no down bias) sum to it."""
    gen = _gen("gpt-oss-torch")
    e, h, inter, m, k = 4, 32, 32, 11, 2
    gate, up, down, gate_b, up_b, down_b, x = (
        t.cpu()
        for t in (
            _randn(e, inter, h, gen=gen, scale=0.3),
            _randn(e, inter, h, gen=gen, scale=0.3),
            _randn(e, h, inter, gen=gen, scale=0.2),
            _randn(e, inter, gen=gen),
            _randn(e, inter, gen=gen),
            _randn(e, h, gen=gen),
            _randn(m, h, gen=gen, scale=2.0),
        )
    )
    weights, ids = (t.cpu() for t in _routing(m, e, k, gen))
    name = "model.layers.0.mlp.experts."
    tensors = {
        name + "gate_proj.weight": gate,
        name + "up_proj.weight": up,
        name + "down_proj.weight": down,
        name + "gate_proj.bias": gate_b,
        name + "up_proj.bias": up_b,
        name + "down_proj.bias": down_b,
    }
    ref = per_token_reference(x, torch.cat([gate, up], 1), down, torch.cat([gate_b, up_b], 1), down_b, weights, ids)
    whole = _load(FusedExperts(e, h, _layout(inter), 0, bias=True, swiglu=SWIGLU), tensors)
    torch.testing.assert_close(whole(x, weights, ids).double(), ref, atol=1e-5, rtol=1e-5)
    halves = [_load(FusedExperts(e, h, _layout(inter, r, 2), 0, bias=True, swiglu=SWIGLU), tensors) for r in (0, 1)]
    assert not halves[1].b2.any()
    torch.testing.assert_close(sum(half(x, weights, ids) for half in halves).double(), ref, atol=1e-5, rtol=1e-5)


def test_missing_bias_is_named():
    module = FusedExperts(2, 8, _layout(8), layer=1, bias=True, swiglu=SWIGLU)
    name = "model.layers.1.mlp.experts."
    for proj, shape in (("gate_proj", (2, 8, 8)), ("up_proj", (2, 8, 8)), ("down_proj", (2, 8, 8))):
        module.load(f"{name}{proj}.weight", torch.zeros(shape), "x")
    module.load(f"{name}gate_proj.bias", torch.zeros(2, 8), "x")
    module.load(f"{name}up_proj.bias", torch.zeros(2, 8), "x")
    with pytest.raises(ValueError, match=r"missing the down bias of experts \[0, 1\] in layer 1"):
        module.finish_loading("x")
