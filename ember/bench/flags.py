"""`ember bench serve`'s flags, and their checks; shared with the scripts in benchmarks/ that call its `benchmark`."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Collection
from typing import Any
from urllib.parse import urlsplit

from ember.bench.workloads import TOKEN_ID_HIGH
from ember.http_client import APIS, COMPLETIONS

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive or inf, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


class _Flags:
    """An argument group that leaves out the flags named in `omit`."""

    def __init__(self, p: argparse.ArgumentParser, title: str, omit: Collection[str]) -> None:
        self.group = p.add_argument_group(title)
        self.omit = omit

    def add_argument(self, *flags: str, **kwargs: Any) -> None:
        if flags[0] not in self.omit:
            self.group.add_argument(*flags, **kwargs)


def add_serve_bench_args(p: argparse.ArgumentParser, omit: Collection[str] = ()) -> None:
    """`ember bench serve`'s flags. A script that calls `benchmark` itself names in `omit` (by first name) the flags
    it sets on its own (benchmarks/serve_sweep.py sets --request-rate per run), so that its users are not offered
    them."""
    g = _Flags(p, "server", omit)
    g.add_argument("--base-url", default=DEFAULT_BASE_URL, help="the server's root URL (default: %(default)s)")
    g.add_argument(
        "--endpoint",
        default=COMPLETIONS,
        choices=tuple(APIS),
        help="completions send token-id prompts; chat, OpenAI's /v1/responses and Anthropic's /v1/messages send "
        "random words as one user message (default: %(default)s)",
    )
    g.add_argument("--model", default=None, help="model name sent in requests (default: the first id of /v1/models)")
    g.add_argument(
        "--api-key",
        default=None,
        help="sent as 'Authorization: Bearer KEY' (default: $EMBER_API_KEY, as `ember serve` reads it)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds one request may take, connection to last byte, before it counts as failed",
    )
    g = _Flags(p, "load", omit)
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument(
        "--request-rate",
        type=_rate,
        default=math.inf,
        help="requests per second, Poisson arrivals (default: inf, every request at once)",
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    g.add_argument(
        "--num-clients",
        type=_positive_int,
        default=1,
        help="client processes sending the requests (default: 1, this one). One process parsing every stream "
        "caps what it measures at high concurrency (TTFT p99 1.07 s where 8 processes saw 0.26 s, 256 streams "
        "on an H200); the same requests and arrival times are dealt round-robin, --max-concurrency is split as "
        "evenly as possible between them, and there is no progress bar",
    )
    g = _Flags(p, "dataset", omit)
    g.add_argument(
        "--dataset",
        choices=("random", "fixed", "nano-vllm"),
        default="random",
        help="random: lengths uniform in [len*(1-r), len*(1+r)]; fixed: exactly the given lengths; "
        "nano-vllm: the offline benchmark's requests (benchmarks/throughput.py), token ids",
    )
    g.add_argument(
        "--random-input-len",
        "--input-len",
        dest="random_input_len",
        type=int,
        default=1024,
        help="prompt tokens (words for chat)",
    )
    g.add_argument(
        "--random-output-len",
        "--output-len",
        dest="random_output_len",
        type=int,
        default=128,
        help="max_tokens of each request",
    )
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="r above, in [0, 1) (random dataset only)")
    g.add_argument(
        "--vocab-size",
        type=int,
        default=TOKEN_ID_HIGH,
        help="prompt token ids are drawn from [100, min(10000, this)); set it below a smaller vocabulary",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="draws the random and fixed prompts; nano-vllm: 0 sends its prompts exactly, another seed "
        "shifts every token id by it (the same lengths, prompts a prefix cache has not seen)",
    )
    g = _Flags(p, "sampling", omit)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos: true so each request generates exactly its max_tokens (Ember, vLLM; on every API)",
    )
    g.add_argument(
        "--extra-body",
        type=_json_object,
        default=None,
        help="JSON object merged into every request body, e.g. '{\"top_k\": 20}'",
    )
    g = _Flags(p, "output", omit)
    g.add_argument("--result-file", default=None, help="write the results as JSON here")
    g.add_argument("--label", default=None, help="a name for this run, kept in the results")
    g.add_argument("--save-detailed", action="store_true", help="also keep every request's inter-token gaps")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar (there is none when not on a tty)")


def check_args(args: argparse.Namespace) -> None:
    problems = [
        (args.num_prompts < 1, "--num-prompts must be >= 1"),
        (args.max_concurrency is not None and args.max_concurrency < 1, "--max-concurrency must be >= 1"),
        (args.random_input_len < 1 or args.random_output_len < 1, "input and output lengths must be >= 1"),
        (not 0 <= args.random_range_ratio < 1, "--random-range-ratio must be in [0, 1)"),
        (args.vocab_size < 2, "--vocab-size must be >= 2"),
        (not args.request_timeout > 0, "--request-timeout must be positive"),
        (args.temperature < 0, "--temperature must be >= 0"),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(message)
    url = urlsplit(args.base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"--base-url must be an http(s) URL, got {args.base_url!r}")
