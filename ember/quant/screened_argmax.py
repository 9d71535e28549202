"""Exact greedy argmax over a float32 LM head for the price of a bf16 matmul.

On CPU the LM head of the default model (a 49152 x 576 Q8_0 matrix kept as exact float32, since
rounding it flips near-tied greedy choices) was a third of a single-stream decode step: the matmul
reads 113 MB per step. Greedy decoding needs only each row's largest logit, so a bf16 copy (half
the bytes, and oneDNN's AVX-512 bf16 kernels) screens the vocabulary, and only the tokens whose
screened logit may still be the largest are recomputed in float32.

The bound on a screened logit's error, with x = xb + dx and w_n = wb_n + e_n (the bf16 roundings
and what they drop): x.w_n - xb.wb_n = x.e_n + dx.wb_n, so by Cauchy-Schwarz it is at most
|x| |e_n| + |dx| |wb_n|, plus float32 accumulation error in both computations (at most K 2^-23
|x| |w_n|, padded to K 2^-22). Measured on the default model, that leaves 1 candidate per row in
the median and at most a few dozen, where a bound from the worst-case roundoff kept hundreds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ScreenedArgmax:
    """argmax_n (x @ weight.T)[n] per row of x, as float32 computes it."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.screen = weight.to(torch.bfloat16)
        wide = self.screen.float()
        screen_norms = torch.linalg.vector_norm(wide, dim=1)
        accumulation = torch.linalg.vector_norm(weight, dim=1).mul_(weight.shape[1] * 2.0 ** -22)
        rounding = torch.linalg.vector_norm(wide.sub_(weight), dim=1)
        # bound[m, n] = |x_m| * per_x[n] + |dx_m| * per_dx[n], one addmm for all rows
        self.coefficients = torch.stack([rounding.add_(accumulation), screen_norms])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] float32 -> [M] int64 token ids."""
        xb = x.to(torch.bfloat16)
        logits = F.linear(xb, self.screen).float()
        norms = torch.stack([x.norm(dim=1), (x - xb.float()).norm(dim=1)], dim=1)  # [M, 2]
        best = logits.argmax(dim=1, keepdim=True)
        lower = logits.gather(1, best) - (norms * self.coefficients[:, best.squeeze(1)].t()).sum(dim=1, keepdim=True)
        upper = torch.addmm(logits, norms, self.coefficients)
        rows, cols = (upper >= lower).nonzero(as_tuple=True)
        exact = (x[rows] * self.weight[cols]).sum(dim=1)
        logits.fill_(float("-inf"))
        logits[rows, cols] = exact
        return logits.argmax(dim=1)

    def tensors(self) -> list[torch.Tensor]:
        """The bf16 copy and the bound's coefficients, for memory accounting (the float32 weight
        belongs to its owner)."""
        return [self.screen, self.coefficients]
