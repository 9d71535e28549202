"""Prompt lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, for the longest n in [min, max] that occurs (Saxena 2023, "Prompt Lookup
Decoding"; vLLM's `ngram` method). No model: answers that copy from the prompt (rewrites, edits,
extraction, code changes) draft themselves.

One vectorised pass finds the earlier occurrences of the last token; each is then extended backwards
up to `max` tokens, latest first. Comparing every n-gram window instead cost 121 us per request on a
600-token sequence (this machine's CPU, numpy), 3.9 ms of host time per step at 32 requests; this
costs ~15 us.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` drafts continuing `token_ids`; empty when no suffix n-gram of at least `min_n`
    tokens recurs."""
    if num_tokens <= 0 or len(token_ids) <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    end = len(tokens) - 1
    # positions before the last whose token is the last token, latest first
    candidates = np.flatnonzero(tokens[:end] == tokens[end])[::-1]
    best_len, best_at = 0, -1
    for i in candidates.tolist():
        n = 1
        while n < max_n and i - n >= 0 and tokens[i - n] == tokens[end - n]:
            n += 1
        if n > best_len:
            best_len, best_at = n, i
            if n == max_n:
                break
    if best_len < min_n:
        return []
    return tokens[best_at + 1 : best_at + 1 + num_tokens].tolist()
