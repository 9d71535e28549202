"""Speculative decoding's figures for `ember bench serve`: the server's `ember:spec_decode_*` counters
(vLLM's names) read from /metrics before and after the run, and what their differences mean."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ember.http_client import http_request

_PREFIX = "ember:spec_decode_"
_GET_TIMEOUT_S = 10.0


async def read_counters(base_url: str, headers: dict[str, str]) -> dict[str, float] | None:
    """The spec-decode counters by sample name (per-position ones as `..._per_pos_total[i]`); None when
    the server exports none (no speculation) or /metrics cannot be read."""

    async def get() -> bytes:
        resp = await http_request("GET", base_url.rstrip("/") + "/metrics", headers=headers)
        try:
            return await resp.read() if resp.status == 200 else b""
        finally:
            await resp.close()

    try:
        text = (await asyncio.wait_for(get(), _GET_TIMEOUT_S)).decode("utf-8", "replace")
    except (OSError, asyncio.TimeoutError, ValueError):
        return None
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(_PREFIX) and sample.name.endswith("_total"):
                position = sample.labels.get("position")
                key = sample.name if position is None else f"{sample.name}[{position}]"
                counters[key] = counters.get(key, 0.0) + sample.value
    return counters or None


def summarize(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """Acceptance rate (accepted / draft tokens), mean accepted length (1 + accepted / drafts: tokens per
    forward pass) and each draft position's acceptance over the run; None without speculation."""
    if after is None:
        return None
    delta = {k: v - (before or {}).get(k, 0.0) for k, v in after.items()}
    drafts = delta.get(_PREFIX + "num_drafts_total", 0.0)
    draft_tokens = delta.get(_PREFIX + "num_draft_tokens_total", 0.0)
    accepted = delta.get(_PREFIX + "num_accepted_tokens_total", 0.0)
    per_pos_key = _PREFIX + "num_accepted_tokens_per_pos_total["
    positions = sorted((int(k[len(per_pos_key) : -1]), v) for k, v in delta.items() if k.startswith(per_pos_key))
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(draft_tokens),
        "num_accepted_tokens": int(accepted),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "acceptance_per_position": [v / drafts if drafts else None for _, v in positions],
    }
