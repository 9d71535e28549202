"""fp8 activation quantization fused into RMSNorm (with and without the residual add) and into
SiLU-and-mul: codes and scales bit for bit what the unfused kernels compose to (norm or activation,
then `quantize_fp8`), in every layout an fp8 linear asks for, and close to the float PyTorch
references. Then the dispatch: which linears of a Llama layer take pre-quantized input, and a tiny fp8
Llama whose greedy tokens and logits are the same with the fusion and without.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before the import);
tests/test_fp8_fused_cuda.py runs the same comparisons compiled on a GPU.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

# The interpreter is chosen when the kernels are decorated, so this must precede the import below.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ember.kernels import (
    fused_add_rms_norm,
    quantize_fp8,
    rms_norm,
    rms_norm_fp8,
    rms_norm_ref,
    silu_and_mul,
    silu_and_mul_fp8,
    silu_and_mul_ref,
)
from ember.quant.formats import FP8_DTYPE, Fp8Activation, Fp8Layout
from ember.quant.quantize import quantize_fp8_activations

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (K, layout): 128-groups (block-scaled weights), a ragged last group, one group of all K (per-channel
# weights, K not a power of two) and the padded, column-major layout of cuBLAS's blockwise GEMM.
LAYOUTS = [
    (256, Fp8Layout(128)),
    (320, Fp8Layout(128)),
    (200, Fp8Layout(200)),
    (256, Fp8Layout(64, column_major_scales=True, row_multiple=16)),
]


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())


def assert_same_activation(fused: Fp8Activation, composed: Fp8Activation) -> None:
    assert fused.rows == composed.rows and fused.dtype == composed.dtype and fused.layout == composed.layout
    assert fused.codes.dtype == FP8_DTYPE and bits_equal(fused.codes, composed.codes)
    assert fused.scales.stride() == composed.scales.stride() and torch.equal(fused.scales, composed.scales)


def assert_close_to_float(a: Fp8Activation, ref: torch.Tensor) -> None:
    """The dequantized activation within e4m3's half step (2^-4 of a value, 2^-10 of its group's scale
    * 448 below the normals) of the float reference, plus the reference's own rounding."""
    k = ref.shape[1]
    scales = a.scales[: a.rows].float().cpu().repeat_interleave(a.layout.group_size, dim=1)[:, :k]
    x = a.codes[: a.rows].float().cpu() * scales
    ref = ref.float().cpu()
    assert ((x - ref).abs() <= 0.07 * ref.abs() + scales * 2**-8).all()
    # the scales map each group's largest value to 448, give or take two bf16 roundings of it
    assert torch.allclose(a.scales[: a.rows].cpu(), quantize_fp8_activations(ref, a.layout.group_size)[1], rtol=3e-2)


def inputs(rows: int, k: int, dtype: torch.dtype, *key: object) -> torch.Tensor:
    gen = _gen(rows, k, dtype, *key)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 8
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,layout", LAYOUTS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_is_norm_then_quantize(k: int, layout: Fp8Layout, dtype: torch.dtype, with_residual: bool) -> None:
    rows = 5
    x = inputs(rows, k, dtype, "x")
    residual = inputs(rows, k, dtype, "r") if with_residual else None
    weight = (1 + 0.5 * inputs(1, k, torch.float32, "w")[0]).to(dtype)
    weight[3] = -weight[3]  # a negative weight: padding rows must still quantize +0
    x_before = x.clone()

    fused, new_residual = rms_norm_fp8(x, residual, weight, 1e-6, layout)

    if residual is None:
        normed = rms_norm(x, weight, 1e-6)
    else:
        normed, summed = fused_add_rms_norm(x, residual, weight, 1e-6)
        assert new_residual is not None and torch.equal(new_residual, summed)
    assert_same_activation(fused, quantize_fp8(normed, layout))
    assert fused.codes.shape[0] == rows + -rows % layout.row_multiple
    assert torch.equal(x, x_before)
    source = x if residual is None else x + residual
    assert_close_to_float(fused, rms_norm_ref(source.cpu().float(), weight.cpu().float(), 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,layout", [*LAYOUTS, (2500, Fp8Layout(128)), (1000, Fp8Layout(1000))])
def test_silu_and_mul_fp8_is_activation_then_quantize(k: int, layout: Fp8Layout, dtype: torch.dtype) -> None:
    """Inter sizes past the plain kernel's 1024-column tile too: 128-groups in 1024-column tiles, and
    one group of 1000 in a single tile."""
    x = inputs(3, 2 * k, dtype, "silu")
    x[0, :128] = 0.0  # gate zero over a whole group: the smallest scale, codes 0

    fused = silu_and_mul_fp8(x, layout)

    assert_same_activation(fused, quantize_fp8(silu_and_mul(x), layout))
    assert_close_to_float(fused, silu_and_mul_ref(x.cpu().float()))


def test_quantize_fp8_pads_like_zero_rows() -> None:
    """The padded layout's extra rows are what quantizing zero rows gives (the cuBLAS path padded x
    with F.pad before quantizing; the kernel now writes the padding itself)."""
    x = inputs(5, 256, torch.bfloat16, "pad")
    layout = Fp8Layout(128, column_major_scales=True, row_multiple=16)
    padded = quantize_fp8(x, layout)
    zeros = torch.cat([x, x.new_zeros(11, 256)])
    reference = quantize_fp8(zeros, Fp8Layout(128, column_major_scales=True))
    assert padded.rows == 5 and padded.scales.stride() == (1, 16)
    assert bits_equal(padded.codes, reference.codes) and torch.equal(padded.scales, reference.scales)


def test_unsupported_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="power-of-two group"):
        silu_and_mul_fp8(inputs(1, 600, torch.float32, "refuse"), Fp8Layout(100))


# ---------------------------------------------------------------- in the model


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory):
    """A tiny Llama whose projections span several 128-input groups (hidden 256, intermediate 384), each
    of a shape of its own (q/k/v 384 outputs, the LM head 512)."""
    from conftest import make_checkpoint

    return make_checkpoint(
        tmp_path_factory.mktemp("fp8") / "llama",
        "llama",
        hidden_size=256,
        intermediate_size=384,
        head_dim=64,
        num_key_value_heads=1,
    )


def generate(
    path, method: str, fused: bool, monkeypatch, lengths: tuple[int, ...] = (3, 40)
) -> tuple[list, dict[tuple[int, int], set[str]]]:
    """Greedy outputs with logprobs for prompts of `lengths` tokens, and what each fp8 layer, by (in, out)
    features, was called on."""
    from ember import LLM, SamplingParams
    from ember.model.linear import QuantLinear
    from ember.ops import registry

    monkeypatch.setattr(registry, "FORCE_TRITON", True)
    monkeypatch.setattr(registry, "FUSE_FP8_QUANT", fused)
    inputs: dict[tuple[int, int], set[str]] = {}

    def record(module: torch.nn.Module, args: tuple) -> None:
        if isinstance(module, QuantLinear):
            shape = (module.parts[0].shape[1], module.out_features)
            inputs.setdefault(shape, set()).add(type(args[0]).__name__)

    hook = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        llm = LLM(
            str(path), quantization=method, kv_cache_memory=0.02, dtype="bfloat16", device=DEVICE, engine_process=False
        )
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
        # one request at a time: which rows share a step would change with the engine thread's timing,
        # and the fp8 GEMM's tiles and splits with the rows
        outs = [llm.generate([{"prompt_token_ids": list(range(5, 5 + n))}], params, use_tqdm=False)[0] for n in lengths]
    finally:
        hook.remove()
    return outs, inputs


@pytest.mark.parametrize("method", ["fp8", "ptpc_fp8"])
def test_fused_quantization_changes_no_logit(fp8_llama, method: str, monkeypatch) -> None:
    """Greedy tokens and their logprobs identical with the fusion and without (the fused kernels give
    the composition's codes bit for bit); with it, q/k/v, gate/up and down take their input quantized
    and o_proj (after attention) and the LM head (whose hidden state others read) quantize their own."""
    fused, fused_inputs = generate(fp8_llama, method, True, monkeypatch)
    plain, plain_inputs = generate(fp8_llama, method, False, monkeypatch)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in a.outputs[0].logprobs] == [
            {t: lp.logprob for t, lp in step.items()} for step in b.outputs[0].logprobs
        ]
    qkv, o, gate_up, down, head = (256, 384), (256, 256), (256, 768), (384, 256), (256, 512)
    assert fused_inputs[qkv] == fused_inputs[gate_up] == fused_inputs[down] == {"Fp8Activation"}
    assert fused_inputs[o] == fused_inputs[head] == {"Tensor"} and all(
        types == {"Tensor"} for types in plain_inputs.values()
    )
