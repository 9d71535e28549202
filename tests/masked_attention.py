"""What the masked-attention kernel tests share (tests/test_sliding_window_kernels.py,
tests/test_chunked_attention_kernels.py, tests/test_attention_sinks.py): dense attention in float64 over
one sequence's paged cache with every mask the kernels take, caches poisoned with NaN where no query may
look (the reference reads clean copies, so a kernel that loads a single poisoned key fails), and a step
laid out as the engine batches it, and decode replayed in a CUDA graph as the runner captures it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from test_kernels import ATTN_TOL, DEVICE, FP8, as_int32

from ember.kernels import paged_decode_attention
from ember.ops.attention import AttentionMetadata

# e4m3fn's NaN bit pattern: the GPU reads NaN, the interpreter 480 (see test_kernels.paged_kv).
FP8_NAN = 0x7F


def dense_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    scale: float,
    *,
    window: int | None = None,
    chunk: int | None = None,
    cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """float64 attention of one sequence's last q.shape[0] positions over its first seq_len keys. A query at p
    sees keys j <= p, within its sliding window (p - window < j: HF's rule) or its chunk (j // chunk ==
    p // chunk: Llama 4's); a capped score is cap * tanh(s / cap), before masking; a sink (one logit per
    query head, gpt-oss) adds exp(sink) to the head's softmax denominator."""
    block_size = k_cache.shape[1]
    pos = torch.arange(seq_len)
    blocks, offsets = table.cpu().long()[pos // block_size], pos % block_size
    k = k_cache.cpu()[blocks, offsets].double() * k_scale  # [S, Hk, D]
    v = v_cache.cpu()[blocks, offsets].double() * v_scale
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.cpu().double(), k) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    q_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
    visible = pos[None, :] <= q_pos
    if window is not None:
        visible &= pos[None, :] > q_pos - window
    if chunk is not None:
        visible &= pos[None, :] // chunk == q_pos // chunk
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)
    weights = scores.exp()
    denominator = weights.sum(-1, keepdim=True) + sinks.cpu().double().exp()[:, None, None]
    return torch.einsum("hqs,shd->qhd", weights / denominator, v)


def poison_before(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches with one sequence's keys and values at positions before `end` (its block table:
    `table`) set to NaN. Blocks are private to a sequence, so poisoning one touches no other."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    if end <= 0:
        return k_cache, v_cache
    block_size = k_cache.shape[1]
    pos = torch.arange(end)
    blocks, offsets = table.long()[pos // block_size], pos % block_size
    for cache in (k_cache, v_cache):
        if cache.dtype == FP8:
            cache.view(torch.uint8)[blocks, offsets] = FP8_NAN
        else:
            cache[blocks, offsets] = float("nan")
    return k_cache, v_cache


def check(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """No NaN (none of the poison reached the output), and within the tolerance of out's computing dtype."""
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu().double(), expected, **ATTN_TOL[dtype], check_dtype=False)


def query_starts(chunks: list[tuple[int, int]]) -> list[int]:
    """Each sequence's first query row in a step of (cached context, new tokens) chunks, then the total."""
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    return starts


def step_metadata(chunks: list[tuple[int, int]], tables: torch.Tensor, num_decodes: int) -> AttentionMetadata:
    """The metadata of a step of (cached context, new tokens) chunks, its first num_decodes one-token decodes,
    with no new keys to store (the caches already hold them)."""
    seq_lens, starts = [c + n for c, n in chunks], query_starts(chunks)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long, device=DEVICE),
        block_tables=tables,
        seq_lens=as_int32(seq_lens),
        query_start_loc=as_int32(starts),
        num_decodes=num_decodes,
        max_query_len=max(n for _, n in chunks[num_decodes:]),
        max_seq_len=max(seq_lens),
        seq_lens_host=seq_lens,
        query_start_host=starts,
    )


def replay_decode_graph(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    layers: list[dict[str, Any]],
    capacity: list[int],
    new_lens: list[int],
    between: Callable[[], None] = lambda: None,
) -> list[torch.Tensor]:
    """As the runner captures decode: one CUDA graph over several layers, each decoding with its own keyword
    arguments (its masking), captured at the `capacity` lengths and replayed once they are `new_lens`, changed
    in place (and `between` has changed in place whatever else the graph should read anew). Returns each
    layer's output."""
    lens = as_int32(capacity)
    outs = [torch.empty_like(q) for _ in layers]

    def step() -> None:
        for kwargs, out in zip(layers, outs):
            paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=out, max_seq_len=256, **kwargs)

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    lens.copy_(as_int32(new_lens))
    between()
    graph.replay()
    torch.cuda.synchronize()
    return outs
