"""GPU only (skipped without CUDA; .devrun/fp8fuse.sh and gpu_suite.sh run it on the H200): what the
interpreter cannot run of the fused fp8 activation quantization. cuBLAS's blockwise GEMM (from
FP8_BLOCK_SCALED_MM_MIN_ROWS rows) fed by a fused norm or SiLU-and-mul in its padded, column-major
layout gives the unfused layer's bits, and a tiny fp8 Llama under CUDA graphs, a prefill of more than
128 rows included, gives the same logits with the fusion and without. tests/test_fp8_fused.py runs
compiled here too (the kernels against their composition, the model on the Triton GEMM's rows)."""

from __future__ import annotations

import pytest
import torch
from test_fp8_fused import fp8_llama, generate  # noqa: F401  (fp8_llama: a fixture)

from ember.kernels import fused_add_rms_norm, rms_norm_fp8, silu_and_mul, silu_and_mul_fp8
from ember.model.linear import QuantLinear
from ember.ops import linear_gpu
from ember.quant.quantize import quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's fp8 GEMMs and CUDA graphs need a GPU")


@pytest.mark.parametrize("method", ["fp8", "ptpc_fp8"])
@pytest.mark.parametrize("rows", [1, 127, 128, 129, 200, 257])
def test_prequantized_input_gives_the_unfused_layers_bits(rows: int, method: str) -> None:
    gen = torch.Generator().manual_seed(rows)
    layer = QuantLinear(
        [quantize(torch.randn(384, 512, generator=gen) * 0.05, method).to("cuda")], None, torch.bfloat16
    )
    x, residual = (torch.randn(rows, 512, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(512, generator=gen)).to("cuda", torch.bfloat16)
    layout = layer.fp8_layout(rows)
    assert layout is not None
    assert layout.column_major_scales == (method == "fp8" and linear_gpu._block_scaled_mm_fits(rows, layer.parts[0]))
    normed, _ = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(layer(rms_norm_fp8(x, residual, weight, 1e-5, layout)[0]), layer(normed))
    gate_up = torch.randn(rows, 1024, generator=gen).to("cuda", torch.bfloat16)
    assert torch.equal(layer(silu_and_mul_fp8(gate_up, layout)), layer(silu_and_mul(gate_up)))


@pytest.mark.parametrize("method", ["fp8", "ptpc_fp8"])
def test_cuda_graphs_and_blockwise_prefill_change_no_logit(fp8_llama, method: str, monkeypatch) -> None:  # noqa: F811
    fused, fused_inputs = generate(fp8_llama, method, True, monkeypatch, lengths=(3, 200))
    plain, _ = generate(fp8_llama, method, False, monkeypatch, lengths=(3, 200))
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in s.items()} for s in a.outputs[0].logprobs] == [
            {t: lp.logprob for t, lp in s.items()} for s in b.outputs[0].logprobs
        ]
    assert "Fp8Activation" in fused_inputs[(384, 256)]  # down_proj
