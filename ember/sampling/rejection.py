"""Verifying draft tokens: keep the longest prefix the target model agrees with, then one token of the
target's own, so that output follows the target's distribution exactly (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding"; Chen et al. 2023).

Every drafter (n-gram lookup, a draft model, an EAGLE-3 head) proposes greedily: its distribution q
is one-hot at the draft token d. A greedy row accepts d when d is the target's argmax. A random row
accepts d with probability min(1, p(d) / q(d)) = p(d), where p is the target's distribution after
every sampling transform (penalties, bias, masks, temperature, min-p, top-k, top-p); on the first
rejection it samples from the residual max(0, p - q), i.e. p without d, renormalised, and when every
draft is accepted it samples a bonus token from the last row's p. Each emitted token so has the
target's distribution whatever the drafts were.

A request with k drafts owns k + 1 consecutive rows: row j is the target's distribution after the
request's tokens and its first j drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.sampling.sampler import exponential_noise
from ember.transfer import to_device


@dataclass
class DraftRows:
    """Where each request's rows lie, and its drafts, padded to the step's longest draft."""

    row_index: torch.Tensor  # [N, K + 1] int64: the request's row for output position j (its last row past k_i)
    draft_ids: torch.Tensor  # [N, K] int64, -1 past each request's drafts
    num_drafts: torch.Tensor  # [N] int64

    @classmethod
    def build(cls, drafts: list[list[int]], device: torch.device) -> DraftRows:
        width = max((len(d) for d in drafts), default=0)
        rows, first = [], 0
        for d in drafts:
            rows.append([first + min(j, len(d)) for j in range(width + 1)])
            first += len(d) + 1
        padded = [d + [-1] * (width - len(d)) for d in drafts]
        return cls(
            to_device(rows, torch.int64, device),
            to_device(padded, torch.int64, device).view(len(drafts), width),
            to_device([len(d) for d in drafts], torch.int64, device),
        )


@dataclass
class Verified:
    token_ids: torch.Tensor  # [N, K + 1] int64: accepted drafts, then the target's token; -1 after
    num_tokens: torch.Tensor  # [N] int64: accepted drafts + 1

    def last_tokens(self) -> torch.Tensor:
        """[N] each request's last emitted token, on the device."""
        return self.token_ids.gather(1, (self.num_tokens - 1).unsqueeze(1)).squeeze(1)


def verify(
    target: torch.Tensor,
    greedy: torch.Tensor,
    rows: DraftRows,
    generators: dict[int, torch.Generator],
) -> Verified:
    """`target` [R, V]: per row the processed logits (a greedy row takes their argmax, a random row
    samples their softmax); `greedy` [N] bool per request; `generators` by request index for seeded
    requests (each draws its uniforms, then its noise, from its own stream)."""
    n, width = rows.draft_ids.shape
    drafts = rows.draft_ids
    valid = torch.arange(width, device=drafts.device).unsqueeze(0) < rows.num_drafts.unsqueeze(1)
    logits = target[rows.row_index]  # [N, K + 1, V]
    argmax = logits.argmax(dim=-1)  # [N, K + 1]
    probs = torch.softmax(logits.float(), dim=-1)
    safe = drafts.clamp(min=0)
    p_draft = probs[:, :width].gather(2, safe.unsqueeze(2)).squeeze(2)  # [N, K]
    uniform, noise = _draws(n, width, probs.shape[-1], generators, probs.device)
    accept = torch.where(greedy.unsqueeze(1), drafts == argmax[:, :width], uniform < p_draft) & valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [N]
    last = probs.gather(1, num_accepted.view(n, 1, 1).expand(n, 1, probs.shape[-1])).squeeze(1)  # [N, V]
    rejected = num_accepted < rows.num_drafts
    rejected_draft = (
        drafts.gather(1, num_accepted.clamp(max=max(width - 1, 0)).unsqueeze(1)).squeeze(1) if width else None
    )
    if rejected_draft is not None:
        residual = last.scatter(1, rejected_draft.clamp(min=0).unsqueeze(1), 0.0)
        # p(d) = 1 with d rejected cannot happen (u < 1); rounding can leave nothing else: keep p then
        usable = rejected & (residual.sum(dim=1) > 0)
        last = torch.where(usable.unsqueeze(1), residual, last)
    sampled = (last.log() - noise.log()).argmax(dim=1)
    final = torch.where(greedy, argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1), sampled)
    return _emitted(drafts, num_accepted, final)


def verify_greedy(argmax: torch.Tensor, rows: DraftRows) -> Verified:
    """Every request greedy, nothing else asked of the logits: `argmax` [R] is each row's choice (a
    quantized head finds it without every float logit, ember.model.linear.QuantEmbedding.argmax)."""
    width = rows.draft_ids.shape[1]
    choice = argmax[rows.row_index]  # [N, K + 1]
    valid = torch.arange(width, device=argmax.device).unsqueeze(0) < rows.num_drafts.unsqueeze(1)
    accept = (rows.draft_ids == choice[:, :width]) & valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    return _emitted(rows.draft_ids, num_accepted, choice.gather(1, num_accepted.unsqueeze(1)).squeeze(1))


def _emitted(drafts: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> Verified:
    """The accepted drafts, then each request's own token (`final`), -1 after."""
    n, width = drafts.shape
    positions = torch.arange(width + 1, device=drafts.device).unsqueeze(0)
    token_ids = torch.cat([drafts, drafts.new_full((n, 1), -1)], dim=1)
    token_ids = torch.where(positions < num_accepted.unsqueeze(1), token_ids, -1)
    token_ids.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return Verified(token_ids, num_accepted + 1)


def _draws(
    n: int, width: int, vocab: int, generators: dict[int, torch.Generator], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms for the acceptance tests and Exp(1) noise for the final draw (the exponential race:
    argmax(log p - log e) picks token i with probability p_i)."""
    uniform = torch.rand(n, width, device=device)
    for i, gen in generators.items():
        uniform[i] = torch.rand(width, device=device, generator=gen)
    return uniform, exponential_noise(n, vocab, generators, device)
