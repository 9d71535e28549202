"""The gated MLP's activation over its fused gate/up projection (`proj`, rows [0, I) gate, [I, 2I) up):
SwiGLU, or GELU-tanh (Gemma, transformers' "gelu_pytorch_tanh"; no fused kernel, PyTorch ops on every
device). Each takes the projection and its input (a tensor, or one quantized for an fp8 projection), so
the native GEMV + SiLU can fuse the two. Where the
down projection is an fp8 linear, SwiGLU can write its output quantized for it (TritonFp8SiluAndMul)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ember.ops.target import Target
from ember.quant.formats import Fp8Activation, Fp8Layout


class TorchGeluTanhAndMul:
    @staticmethod
    def can_implement(target: Target, act: str, proj: Any) -> bool:
        return act == "gelu_pytorch_tanh"

    def __call__(self, proj: Any, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        gate, up = proj(x).chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class TritonSiluAndMul:
    @staticmethod
    def can_implement(target: Target, act: str, proj: Any) -> bool:
        return act == "silu" and target.triton

    def __call__(self, proj: Any, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        from ember.kernels import silu_and_mul

        return silu_and_mul(proj(x))


class TritonFp8SiluAndMul:
    """TritonSiluAndMul's output already quantized in the layout of the fp8 linear (down_proj) that reads
    it, in the same launch (bit for bit the activation, then that linear's quantize)."""

    @staticmethod
    def can_implement(target: Target, act: str) -> bool:
        return act == "silu" and target.triton

    def __call__(self, proj: Any, x: torch.Tensor | Fp8Activation, layout: Fp8Layout) -> Fp8Activation:
        from ember.kernels import silu_and_mul_fp8

        return silu_and_mul_fp8(proj(x), layout)


class TorchSiluAndMul:
    @staticmethod
    def can_implement(target: Target, act: str, proj: Any) -> bool:
        return act == "silu"

    def __call__(self, proj: Any, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        gate, up = proj(x).chunk(2, dim=-1)
        return F.silu(gate) * up


class NativeSiluAndMul(TorchSiluAndMul):
    """A projection that is one native weight (QuantLinear.native_gemv_weight): GEMV and activation in one
    native call (QuantLinear.native_silu_and_mul) where it takes x, PyTorch's ops otherwise."""

    @staticmethod
    def can_implement(target: Target, act: str, proj: Any) -> bool:
        gemv = getattr(proj, "native_gemv_weight", None)
        return act == "silu" and target.native and gemv is not None and gemv() is not None

    def __call__(self, proj: Any, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        fused = proj.native_silu_and_mul(x)
        return fused if fused is not None else super().__call__(proj, x)
