"""Exact greedy argmax over a float32 LM head for the price of a bf16 matmul.

On CPU the LM head of the default model (a 49152 x 576 Q8_0 matrix kept as exact float32, since
rounding it flips near-tied greedy choices) was a third of a single-stream decode step: the matmul
reads 113 MB per step. Greedy decoding needs only each row's largest logit, so a bf16 copy (half
the bytes, and oneDNN's AVX-512 bf16 kernels) screens the vocabulary, and only the tokens whose
screened logit may still be the largest are recomputed in float32. (An int8 copy with one scale
per row reads half as much again, but its coarser bound keeps tens of candidates per row, and it
measured slower in the engine.)

The bound on a screened logit's error, with x = xb + dx and w_n = wb_n + e_n (the bf16 roundings
and what they drop): x.w_n - xb.wb_n = x.e_n + dx.wb_n, at most |x| |e_n| + |dx| |wb_n| by
Cauchy-Schwarz; plus float32 accumulation error in both computations (at most K 2^-23 |x| |w_n|,
padded to K 2^-22); plus the rounding of the matmul's output to bf16, at most 2^-9 of the logit,
bounded by 2^-8 of the rounded one. Measured on the default model, that leaves one candidate per
row in the median and a few dozen at most.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _coefficients(weight: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """[2, N]: the bound on row m's logit n is |x_m| c[0, n] + |dx_m| c[1, n] (plus the output
    rounding). `rounded` is the screen's weight in float32; it is overwritten."""
    rounded_norms = torch.linalg.vector_norm(rounded, dim=1)
    accumulation = torch.linalg.vector_norm(weight, dim=1).mul_(weight.shape[1] * 2.0**-22)
    rounding = torch.linalg.vector_norm(rounded.sub_(weight), dim=1)
    return torch.stack([rounding.add_(accumulation), rounded_norms])


class ScreenedArgmax:
    """argmax_n (x @ weight.T)[n] per row of x, as float32 computes it."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.bf16 = weight.to(torch.bfloat16)
        self.coefficients = _coefficients(weight, self.bf16.float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] float32 -> [M] int64 token ids."""
        xb = x.to(torch.bfloat16)
        logits = F.linear(xb, self.bf16).float()
        norms = torch.stack([x.norm(dim=1), (x - xb.float()).norm(dim=1)], dim=1)  # [M, 2]
        slack = torch.addmm(logits.abs().mul_(2.0**-8), norms, self.coefficients)
        best = logits.argmax(dim=1, keepdim=True)
        lower = logits.gather(1, best) - slack.gather(1, best)
        rows, cols = (slack.add_(logits) >= lower).nonzero(as_tuple=True)
        exact = (x[rows] * self.weight[cols]).sum(dim=1)
        logits.fill_(float("-inf"))
        logits[rows, cols] = exact
        return logits.argmax(dim=1)

    def tensors(self) -> list[torch.Tensor]:
        """The bf16 copy and the bound's coefficients, for memory accounting (the float32 weight
        belongs to its owner)."""
        return [self.bf16, self.coefficients]
