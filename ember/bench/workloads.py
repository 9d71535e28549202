"""The design doc's offline workload (nano-vllm's bench.py draws), shared by the offline and serving benchmarks."""

from __future__ import annotations

import random

# 256 requests, prompts of 100-1024 tokens and 100-1024 new tokens, random.seed(0)
NANO_VLLM_OUTPUT_TOKENS = 133_966


def nano_vllm_requests(num_seqs: int = 256, min_input: int = 100, max_input: int = 1024, min_output: int = 100,
                       max_output: int = 1024, vocab_size: int = 10001) -> tuple[list[list[int]], list[int]]:
    """(prompts, max_tokens) in nano-vllm's order: every prompt first, then every length; ids are folded into
    the vocabulary, a no-op above 10,000 tokens."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) % vocab_size for _ in range(rng.randint(min_input, max_input))]
               for _ in range(num_seqs)]
    max_tokens = [rng.randint(min_output, max_output) for _ in range(num_seqs)]
    if (num_seqs, min_input, max_input, min_output, max_output) == (256, 100, 1024, 100, 1024):
        assert sum(max_tokens) == NANO_VLLM_OUTPUT_TOKENS, f"{sum(max_tokens)} output tokens, not nano-vllm's workload"
    return prompts, max_tokens
