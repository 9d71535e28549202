"""The CPU paths of the decoder's building blocks compute Hugging Face's formulas bit for bit."""

from __future__ import annotations

import pytest
import torch

from ember.model.layers import RMSNorm, RotaryEmbedding


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def hf_rotary(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = q.shape[-1] // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    return q * cos + rotated * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 4096])
def test_rms_norm_is_hf_bit_for_bit(hidden: int, dtype: torch.dtype, monkeypatch) -> None:
    """The PyTorch path; the native one (float32 on AVX-512 CPUs) sums squares in its own order, tested
    in tests/test_cpu_native_fused.py."""
    monkeypatch.setenv("EMBER_CPU_NATIVE", "0")
    gen = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    x, residual = ((torch.randn(9, hidden, generator=gen) * 4).to(dtype) for _ in range(2))
    with torch.no_grad():
        assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-5))
        out, summed = norm(x, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(out, hf_rms_norm(x + residual, norm.weight, 1e-5))


def test_rotary_is_hf_bit_for_bit_and_follows_each_steps_positions() -> None:
    gen = torch.Generator().manual_seed(0)
    rotary = RotaryEmbedding(64, 256, 10000.0, None)
    for positions in (torch.tensor([5, 6, 7]), torch.tensor([200, 3, 64])):  # two steps, two tensors
        q = torch.randn(3, 9, 64, generator=gen)
        k = torch.randn(3, 3, 64, generator=gen)
        for _ in range(2):  # the second layer of a step reuses the step's rows
            q_rot, k_rot = rotary(positions, q, k)
            cos, sin = rotary.cos[positions][:, None], rotary.sin[positions][:, None]
            assert torch.equal(q_rot, hf_rotary(q, cos, sin))
            assert torch.equal(k_rot, hf_rotary(k, cos, sin))


@pytest.mark.parametrize("rotary_dim", [None, 32])  # every channel (one pass), a partial rotary (two)
def test_rotate_qk_on_the_fused_qkv_columns_equals_rotating_q_and_k(rotary_dim: int | None) -> None:
    gen = torch.Generator().manual_seed(1)
    rotary = RotaryEmbedding(64, 256, 10000.0, None, rotary_dim)
    positions = torch.tensor([0, 17, 255])
    qkv = torch.randn(3, (9 + 3 + 3) * 64, generator=gen)
    qk = qkv[:, : 12 * 64].view(3, 12, 64)  # a strided view, as Attention.forward passes it
    q_rot, k_rot = rotary.rotate_qk(positions, qk, 9)
    q_ref, k_ref = rotary(positions, qk[:, :9].clone(), qk[:, 9:].clone())
    assert q_rot.shape == (3, 9, 64) and k_rot.shape == (3, 3, 64)
    assert torch.equal(q_rot, q_ref) and torch.equal(k_rot, k_ref)
