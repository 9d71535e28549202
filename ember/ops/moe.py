"""The mixture-of-experts MLP's routing and expert computation (ember.model.moe.SparseMoeBlock): the
fused MoE kernels (ember/kernels/fused_moe.py) with their own routing, or the experts module's PyTorch
path over transformers' routing."""

from __future__ import annotations

from typing import Any

import torch

from ember.ops.target import Target


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [M, k], expert ids [M, k]) as transformers computes them."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class TritonMoe:
    @staticmethod
    def can_implement(target: Target) -> bool:
        return target.triton

    def __call__(
        self, experts: Any, x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> torch.Tensor:
        from ember.kernels import fused_moe_from_logits

        w13, w2 = experts.w13, experts.w2
        return fused_moe_from_logits(
            x, w13, w2, logits, top_k, renormalize, b13=experts.b13, b2=experts.b2, swiglu=experts.swiglu
        )


class TorchMoe:
    @staticmethod
    def can_implement(target: Target) -> bool:
        return True

    def __call__(
        self, experts: Any, x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> torch.Tensor:
        return experts(x, *route(logits, top_k, renormalize))
