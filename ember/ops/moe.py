"""The mixture-of-experts MLP's routing and expert computation (ember.model.moe.SparseMoeBlock): the
fused MoE kernels (ember/kernels/fused_moe.py) with their own routing, or the experts module's PyTorch
path over transformers' routing.

Llama 4 routes otherwise ("sigmoid-input"): the sigmoid of each token's top-k router logits scales the
chosen experts' *input*, not their output (the activation between the projections makes the two
differ). Its token-choice pairs become rows of their own, x * weight, each sent to one expert with
weight 1 through the same experts path, then summed per token (k = 1, every released Llama 4: the
rows are the tokens, nothing to sum).

DeepSeek's grouped routing (`route_grouped`) runs in PyTorch on either device and hands its choice to
the same expert computation (`routed`)."""

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


def route_sigmoid(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's (weights float32 [M, k], expert ids [M, k]): the top-k logits through a sigmoid (the
    others' sigmoid(-inf) = 0 in transformers, their experts fed zeros, which add nothing)."""
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.sigmoid(values.float()), ids


def input_weighted_rows(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each (token, choice) as its own row x[t] * weights[t, j] ([M * k, H], x's dtype), that row's expert
    [M * k, 1] and a weight of 1 for it."""
    rows = (x[:, None, :] * weights[..., None].to(x.dtype)).reshape(-1, x.shape[1])
    flat = ids.reshape(-1, 1)
    return rows, torch.ones(flat.shape, dtype=torch.float32, device=x.device), flat


def _per_token(out: torch.Tensor, top_k: int) -> torch.Tensor:
    """[M * k, H] rows of token-choice pairs -> [M, H], each token's k summed."""
    return out if top_k == 1 else out.view(-1, top_k, out.shape[1]).sum(dim=1)


def route_grouped(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    routing: Any,
    score_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing (`routing`: ember.model.hf_config.GroupedRouting), as transformers' DeepseekV2 /
    DeepseekV3 routers compute it: (weights float32 [M, k], expert ids [M, k]).

    V2: softmax scores; group_limited_greedy keeps the `topk_group` groups of highest best score (the others'
    scores become 0), then the top k. V3 (noaux_tc): sigmoid scores; the choice is made on scores + the
    correction bias, groups ranked by the sum of their two best, the others' at -inf; the weights are the
    chosen experts' scores without the bias. Then renormalised (V3's + 1e-20), times routed_scaling_factor."""
    logits = router_logits.float()
    scores = logits.sigmoid() if routing.sigmoid else logits.softmax(dim=-1)
    choice = scores if score_bias is None else scores + score_bias.float()
    m, e = choice.shape
    if routing.n_group > 1:
        grouped = choice.view(m, routing.n_group, e // routing.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if routing.sigmoid else grouped.amax(dim=-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(routing.topk_group, dim=-1)[1], 1.0)
        keep = keep.bool().unsqueeze(-1).expand_as(grouped).reshape(m, e)
        choice = choice.masked_fill(~keep, float("-inf") if routing.sigmoid else 0.0)
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if routing.sigmoid else 0.0))
    return weights * routing.scaling, ids


class TritonMoe:
    @staticmethod
    def can_implement(target: Target) -> bool:
        return target.triton

    def __call__(
        self,
        experts: Any,
        x: torch.Tensor,
        logits: torch.Tensor,
        top_k: int,
        renormalize: bool,
        routing: str = "softmax",
    ) -> torch.Tensor:
        from ember.kernels import fused_moe, fused_moe_from_logits

        w13, w2 = experts.w13, experts.w2
        if routing == "sigmoid-input":
            rows, ones, ids = input_weighted_rows(x, *route_sigmoid(logits, top_k))
            out = fused_moe(rows, w13, w2, ones, ids.int(), b13=experts.b13, b2=experts.b2, swiglu=experts.swiglu)
            return _per_token(out, top_k)
        return fused_moe_from_logits(
            x, w13, w2, logits, top_k, renormalize, b13=experts.b13, b2=experts.b2, swiglu=experts.swiglu
        )

    def routed(self, experts: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for a routing chosen elsewhere (DeepSeek's, `route_grouped`)."""
        from ember.kernels import fused_moe

        return fused_moe(
            x,
            experts.w13,
            experts.w2,
            weights,
            ids.to(torch.int32),
            b13=experts.b13,
            b2=experts.b2,
            swiglu=experts.swiglu,
        )


class TorchMoe:
    @staticmethod
    def can_implement(target: Target) -> bool:
        return True

    def __call__(
        self,
        experts: Any,
        x: torch.Tensor,
        logits: torch.Tensor,
        top_k: int,
        renormalize: bool,
        routing: str = "softmax",
    ) -> torch.Tensor:
        if routing == "sigmoid-input":
            return _per_token(experts(*input_weighted_rows(x, *route_sigmoid(logits, top_k))), top_k)
        return experts(x, *route(logits, top_k, renormalize))

    def routed(self, experts: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return experts(x, weights, ids)
