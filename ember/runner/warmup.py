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

from ember.runner.step import NewRequest, StepDescription
from ember.sampling.params import SamplingParams

_CHUNK_LENGTHS = (2, 3, 5, 9, 17, 33, 65, 129)  # query rows next_power_of_2(len * group) span 16..128
_FIRST_ROW_BUCKET = 256  # the largest decode batch CUDA graphs capture: smaller row counts are compiled then


def _add_request(
    step: StepDescription, name: str, num_tokens: int, num_computed: int, block_size: int, first_block: int
) -> int:
    """Schedule a new greedy request of `num_tokens` zeros, all but the first `num_computed` of them
    computed in this step, over consecutive blocks from `first_block`; returns its number of blocks."""
    num_blocks = -(-num_tokens // block_size)
    step.new_requests.append(NewRequest(name, [0] * num_tokens, SamplingParams(temperature=0.0), []))
    step.add(name, num_tokens - num_computed, num_computed, 0, [], list(range(first_block, first_block + num_blocks)))
    return num_blocks


def warm_up_batches(
    block_size: int, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
) -> list[StepDescription]:
    """One batch per chunk length: a decode over one block of context (when two sequences fit in a
    batch), and a chunk after one block of context; within the scheduler's limits. Block contents
    are whatever the pool holds: only the kernels' compilation matters."""
    batches = []
    with_decode = max_num_seqs >= 2
    for n in _CHUNK_LENGTHS:
        step, first_block = StepDescription(), 0
        if with_decode:
            first_block = _add_request(step, "warm-up-decode", block_size + 1, block_size, block_size, 0)
        chunk_blocks = _add_request(step, "warm-up-chunk", block_size + n, block_size, block_size, first_block)
        too_long = block_size + n > max_model_len  # a block table holds max_model_len tokens' blocks
        if too_long or first_block + chunk_blocks > num_blocks or n + with_decode > max_num_batched_tokens:
            break
        batches.append(step)
    return batches + _row_bucket_batches(block_size, num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len)


def _row_bucket_batches(
    block_size: int, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
) -> list[StepDescription]:
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
        step = StepDescription()
        for i, n in enumerate(lengths):
            _add_request(step, f"warm-up-prefill-{i}", n, 0, block_size, 0)
        batches.append(step)
        rows *= 2
    return batches
