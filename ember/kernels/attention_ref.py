"""Plain float32 attention over a paged cache: the yardstick the attention kernels are tested against.

Deliberately naive (gather, repeat heads, masked softmax) so its correctness is evident by reading.
"""

from __future__ import annotations

import torch

from ember.quant.kv_scale import KVScale, dequantize_kv


def gather_context(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    *,
    k_scale: KVScale = 1.0,
    v_scale: KVScale = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `seq_len` keys and values of one sequence, [seq_len, Hk, D] each; an fp8 cache's
    are dequantized to float32, so the kernels are held to exactly the values the cache stands for."""
    blocks = block_table[: -(-seq_len // k_cache.shape[1])].long()
    k = dequantize_kv(k_cache[blocks].flatten(0, 1)[:seq_len], k_scale, torch.float32)
    v = dequantize_kv(v_cache[blocks].flatten(0, 1)[:seq_len], v_scale, torch.float32)
    return k, v


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    context_len: int,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    query_limits: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Float32 attention of queries [Q, Hq, D] at positions context_len.. over keys [S, Hk, D],
    each query at p seeing keys j with p - sliding_window < j <= p (no lower bound without a
    window; `causal` False: every key); scores capped to cap * tanh(s / cap) with
    `logits_soft_cap`; `sinks` [Hq]: one more logit per head in each row's softmax, whose
    probability is dropped (it has no value). `attention_chunk` C (Llama 4's local layers): a query at
    p sees keys j with (p // C) * C <= j <= p, those of its own chunk (transformers' chunked mask).

    `query_limits` [Q] (causal only) moves each query's last key from p to its limit L, p <= L < S:
    Gemma 3's image tokens see their whole image (L: its last token), transformers' OR(causal, same
    image block). The window still counts from p, so a query sees p - sliding_window < j <= L. That is
    transformers 5's sliding rule, AND(window, OR(causal, block)) (gemma3's
    `create_masks_for_vision_model`), exactly; 4.x's OR(AND(causal, window), block) agrees with it
    only while an image block is shorter than the window, which Gemma 3's are (256 tokens against the
    vision models' 1024)."""
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # [Hq, Q, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = qf @ kf.transpose(1, 2) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    q_pos = context_len + torch.arange(q.shape[0], device=q.device)
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    last = q_pos if query_limits is None else _checked_limits(query_limits, q_pos, k.shape[0], causal)
    visible = k_pos <= last[:, None] if causal else torch.ones_like(k_pos, dtype=torch.bool).expand(q.shape[0], -1)
    if sliding_window is not None:
        visible &= k_pos > q_pos[:, None] - sliding_window
    if attention_chunk is not None:
        visible &= k_pos // attention_chunk == q_pos[:, None] // attention_chunk
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(-1, q.shape[0], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return (probs @ vf).transpose(0, 1)  # [Q, Hq, D]


def _checked_limits(query_limits: torch.Tensor, q_pos: torch.Tensor, seq_len: int, causal: bool) -> torch.Tensor:
    """The limits, once shown to be what the kernels assume without checking: each at or past its
    query's own position and inside the sequence (the scheduler keeps an image's tokens in one chunk)."""
    if not causal:
        raise ValueError("query_limits: a bidirectional (causal=False) attention already sees every key")
    limits = query_limits.to(q_pos.device, torch.long)
    if limits.shape != q_pos.shape or (limits < q_pos).any() or (limits >= seq_len).any():
        raise ValueError(
            f"query_limits {limits.tolist()} must lie in [position, {seq_len}) for positions {q_pos.tolist()}"
        )
    return limits
