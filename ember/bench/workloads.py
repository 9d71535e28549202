"""What the benchmarks send: the design doc's offline workload (nano-vllm's bench.py draws), shared by the
offline and serving benchmarks, and `ember bench serve`'s seeded requests, their bodies and arrival times."""

from __future__ import annotations

import argparse
import copy
import math
import random
from dataclasses import dataclass
from typing import Any

from ember.http_client import APIS

# 256 requests, prompts of 100-1024 tokens and 100-1024 new tokens, random.seed(0)
NANO_VLLM_OUTPUT_TOKENS = 133_966
# vLLM's random dataset draws prompt token ids from [100, 10000); --vocab-size clamps the top.
TOKEN_ID_LOW, TOKEN_ID_HIGH = 100, 10000

# Chat prompts are random words: a chat template needs text, and these tokenize to about one token
# each in the usual BPE vocabularies. Input token counts then come from the server's `usage`.
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "one",
    "all",
    "we",
    "their",
    "been",
    "has",
    "when",
    "who",
    "will",
    "more",
    "no",
    "if",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "small",
    "river",
    "light",
    "water",
    "house",
    "city",
]


def nano_vllm_requests(
    num_seqs: int = 256,
    min_input: int = 100,
    max_input: int = 1024,
    min_output: int = 100,
    max_output: int = 1024,
    vocab_size: int = 10001,
) -> tuple[list[list[int]], list[int]]:
    """(prompts, max_tokens) in nano-vllm's order: every prompt first, then every length; ids are folded into
    the vocabulary, a no-op above 10,000 tokens."""
    rng = random.Random(0)
    prompts = [
        [rng.randint(0, 10000) % vocab_size for _ in range(rng.randint(min_input, max_input))] for _ in range(num_seqs)
    ]
    max_tokens = [rng.randint(min_output, max_output) for _ in range(num_seqs)]
    if (num_seqs, min_input, max_input, min_output, max_output) == (256, 100, 1024, 100, 1024):
        assert sum(max_tokens) == NANO_VLLM_OUTPUT_TOKENS, f"{sum(max_tokens)} output tokens, not nano-vllm's workload"
    return prompts, max_tokens


@dataclass
class RequestSpec:
    prompt: list[int] | str
    prompt_len: int  # tokens for a token-id prompt; words for a chat prompt (the server's usage counts tokens)
    output_len: int  # max_tokens


def sample_lengths(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    """Uniform integers in [length * (1 - ratio), length * (1 + ratio)], at least 1."""
    low, high = max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def make_requests(args: argparse.Namespace) -> list[RequestSpec]:
    """Seeded: the same flags give the same prompts. Input lengths are drawn first, then output lengths."""
    if args.dataset == "nano-vllm":
        prompts, max_tokens = nano_vllm_requests(args.num_prompts, vocab_size=args.vocab_size)
        # Seed 0 is the workload exactly. Another run against the same server would find every prompt in its
        # prefix cache; shifting the ids by the seed keeps the lengths (the work) and makes the prompts new.
        prompts = [[(t + args.seed) % args.vocab_size for t in p] for p in prompts]
        return [RequestSpec(p, len(p), n) for p, n in zip(prompts, max_tokens)]
    rng = random.Random(args.seed)
    ratio = args.random_range_ratio if args.dataset == "random" else 0.0
    input_lens = sample_lengths(rng, args.num_prompts, args.random_input_len, ratio)
    output_lens = sample_lengths(rng, args.num_prompts, args.random_output_len, ratio)
    high = min(TOKEN_ID_HIGH, args.vocab_size)
    low = TOKEN_ID_LOW if high > TOKEN_ID_LOW else 0
    specs = []
    for n_in, n_out in zip(input_lens, output_lens):
        if APIS[args.endpoint].chat:
            prompt: list[int] | str = " ".join(rng.choice(WORDS) for _ in range(n_in))
        else:
            prompt = [rng.randrange(low, high) for _ in range(n_in)]
        specs.append(RequestSpec(prompt, n_in, n_out))
    return specs


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process (exponential gaps), or all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)  # its own stream: the arrivals do not depend on the prompts drawn
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def request_body(args: argparse.Namespace, model: str, spec: RequestSpec) -> dict[str, Any]:
    """A streaming request of `args.endpoint`'s API, in its own shape (see `ember.http_client.APIS`)."""
    api = APIS[args.endpoint]
    body: dict[str, Any] = {"model": model, "temperature": args.temperature, **copy.deepcopy(api.stream)}
    body.update(api.request(spec.prompt, spec.output_len))
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(args.extra_body or {})
    return body
