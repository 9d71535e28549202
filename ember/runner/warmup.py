"""Batches that make Triton compile, at start-up, the kernel variants serving meets later.

Triton compiles a kernel per tile configuration on first use. The start-up forward (the memory
profile) and the CUDA graph capture cover full-length prefills and pure decode batches, but not
short prefill chunks over a cached context mixed with decodes, which appear only once requests
hit the prefix cache or get chunked: on an H200 the first such step compiled for 2.5 s inside a
user's time to first token. These batches cover every prefill tile height (16 to 128 query rows)
for any GQA group size, each next to a decode and over a context of one block.

Kernels tuned by row count (the fused MoE table, ember/kernels/moe_configs.json, has one tile
configuration per power of two up to 1024 rows) also meet row counts between the largest captured
decode batch and the start-up forward's full batch: the first 512-token prompt of Qwen3-30B-A3B
compiled the 512-row MoE variant inside its first step (a batch-1 run on the H200 averaged 14.7 ms
per token over 128 tokens, 3.9 ms warm). So one prefill per power of two from 256 rows on runs too.
"""

from __future__ import annotations

from ember.core.request import Request
from ember.core.scheduler import ScheduledBatch
from ember.sampling.params import SamplingParams

_CHUNK_LENGTHS = (2, 3, 5, 9, 17, 33, 65, 129)  # query rows next_power_of_2(len * group) span 16..128
_FIRST_ROW_BUCKET = 256  # the largest decode batch CUDA graphs capture: smaller row counts are compiled then


def _request(name: str, num_tokens: int, num_computed: int, block_size: int, first_block: int) -> Request:
    req = Request(name, [0] * num_tokens, SamplingParams(temperature=0.0), 1, [], 0.0)
    req.num_computed_tokens = num_computed
    req.block_ids = list(range(first_block, first_block + -(-num_tokens // block_size)))
    return req


def warm_up_batches(block_size: int, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                    max_model_len: int) -> list[ScheduledBatch]:
    """One batch per chunk length: a decode over one block of context (when two sequences fit in a
    batch), and a chunk after one block of context; within the scheduler's limits. Block contents
    are whatever the pool holds: only the kernels' compilation matters."""
    batches = []
    with_decode = max_num_seqs >= 2
    for n in _CHUNK_LENGTHS:
        decode = _request("warm-up-decode", block_size + 1, block_size, block_size, 0)
        first_block = len(decode.block_ids) if with_decode else 0
        chunk = _request("warm-up-chunk", block_size + n, block_size, block_size, first_block)
        if first_block + len(chunk.block_ids) > num_blocks or n + with_decode > max_num_batched_tokens:
            break
        batches.append(ScheduledBatch([decode, chunk], [1, n]) if with_decode else ScheduledBatch([chunk], [n]))
    return batches + _row_bucket_batches(block_size, num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len)


def _row_bucket_batches(block_size: int, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                        max_model_len: int) -> list[ScheduledBatch]:
    """Fresh prefills of 2^k + 1 tokens in all for each power of two 2^k from _FIRST_ROW_BUCKET on that
    leaves a larger batch possible (the start-up forward covers the full one), cut into sequences of
    at most max_model_len tokens. They all write the same blocks: only the kernels' compilation matters."""
    batches = []
    rows = _FIRST_ROW_BUCKET
    while rows < max_num_batched_tokens - 1:
        total = rows + 1
        lengths = [min(max_model_len, total - start) for start in range(0, total, max_model_len)]
        if len(lengths) > max_num_seqs or -(-lengths[0] // block_size) > num_blocks:
            break
        batches.append(ScheduledBatch([_request("warm-up-prefill", n, 0, block_size, 0) for n in lengths], lengths))
        rows *= 2
    return batches
