"""Speculative decoding's acceptance counters, kept by the core and sent with every step's stats."""

from __future__ import annotations

from dataclasses import dataclass

from ember.messages import SpecDecodeStats


@dataclass
class SpecDecodeCounts:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]

    @classmethod
    def empty(cls, k: int) -> SpecDecodeCounts:
        return cls(0, 0, 0, [0] * k)

    def add(self, num_drafts: int, num_accepted: int) -> None:
        """One request's drafts in one step: `num_accepted` of its `num_drafts` (a prefix) were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def message(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos)
        )
