"""`ember bench serve`: a serving benchmark client for any OpenAI-compatible server.

It sends `--num-prompts` streaming requests to a running server (Ember, vLLM, llama.cpp's server,
...) with Poisson arrivals at `--request-rate` (or all at once), optionally capped at
`--max-concurrency` requests in flight, from one client process or `--num-clients` of them (so that
the client never sets the pace: `ember.bench.processes` says why), and reports what a user of the
server sees. The metric
names and definitions follow vLLM's `benchmark_serving`:

- TTFT: seconds from sending a request to the first chunk that carries output: text, or (as vLLM
  streams) a chunk for tokens whose text is not out yet (an unfinished character, a model served
  without a tokenizer); a chat stream's opening role-only chunk does not count;
- ITL: the gaps between consecutive such chunks (a chunk may hold several tokens);
- TPOT: (E2E - TTFT) / (output tokens - 1), per request, for requests with more than one token;
- E2E: seconds from sending a request to the end of its stream;
- request, input, output and total token throughput over the whole run (successful requests only).

Output token counts come from the stream's final `usage` chunk (`stream_options.include_usage`),
or, where a server sends none, from the number of chunks that carried output.

`--endpoint` picks the API: OpenAI's completions (token-id prompts) or chat completions, OpenAI's
Responses API (`/v1/responses`) or Anthropic's Messages API (`/v1/messages`), the last three sending the
same random-word user message in their own request shapes. For those two, an output-carrying chunk is a
text, reasoning or tool-arguments delta event, the stream ends with `response.completed` /
`message_stop`, and usage comes from their final events (`ember.http_client.APIS`).

    ember serve &                                               # or any OpenAI-compatible server
    ember bench serve --num-prompts 200 --random-input-len 512 --random-output-len 128 --request-rate 8 \\
        --result-file serve.json

The HTTP client is Ember's own (`ember.http_client`); `ember.bench.workloads` draws the requests,
`ember.bench.client` sends them at their arrival times (`ember.bench.processes` from N processes),
`ember.bench.report` computes the metrics and `ember.bench.flags` defines the flags; this module puts
them together and assembles the result document.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ember.bench import spec_metrics
from ember.bench.client import Share, send_share
from ember.bench.flags import add_serve_bench_args, check_args
from ember.bench.machine import client_machine_info
from ember.bench.processes import ClientProcessError, deal, num_processes, run_in_processes
from ember.bench.report import RequestResult, print_report, request_records, summarize
from ember.bench.workloads import arrival_times, make_requests
from ember.http_client import HTTPStatusError, ProtocolError, get_json


async def run_requests(
    args: argparse.Namespace, model: str, shares: Sequence[Share], headers: dict[str, str]
) -> tuple[list[RequestResult], float]:
    """All requests at their arrival times, in this process or in one process per share; returns the results in
    request order and the duration."""
    if len(shares) > 1:
        return await run_in_processes(args, model, shares, headers)
    t0 = time.perf_counter()
    results, end = await send_share(args, model, shares[0], headers, t0, progress=not args.disable_tqdm)
    return results, end - t0


def _load_text(args: argparse.Namespace, shares: Sequence[Share]) -> str:
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
    text = f"request rate {rate}, max concurrency {args.max_concurrency or 'unlimited'}"
    if len(shares) == 1:
        return text
    caps = sorted({s.max_concurrency for s in shares if s.max_concurrency is not None}, reverse=True)
    split = f" ({' or '.join(map(str, caps))} per process)" if caps else ""
    return f"{text}{split}, {len(shares)} client processes"


async def _resolve_model(args: argparse.Namespace, headers: dict[str, str]) -> tuple[str, Any]:
    url = args.base_url.rstrip("/") + "/v1/models"
    try:
        models = await get_json(url, headers)
    except (
        asyncio.TimeoutError,
        OSError,
        ProtocolError,
        HTTPStatusError,
        ValueError,
        asyncio.IncompleteReadError,
    ) as e:
        if args.model is not None:  # not needed: carry on without the server's description
            return args.model, None
        why = str(e) if isinstance(e, HTTPStatusError) else f"{type(e).__name__}: {e}; is the server up?"
        raise ValueError(f"cannot list the models at {url} ({why}); or pass --model") from None
    if args.model is not None:
        return args.model, models
    try:
        return models["data"][0]["id"], models
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"{url} lists no model; pass --model") from None


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark the flags describe and return the result document (what --result-file holds)."""
    check_args(args)
    machine = client_machine_info()
    api_key = args.api_key or os.environ.get("EMBER_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model, models = await _resolve_model(args, headers)
    specs = make_requests(args)
    n = num_processes(args.num_clients, len(specs), args.max_concurrency)
    shares = deal(specs, arrival_times(len(specs), args.request_rate, args.seed), args.max_concurrency, n)
    print(
        f"{len(specs)} requests to {args.base_url.rstrip('/')}{args.endpoint} (model {model}), "
        + _load_text(args, shares),
        flush=True,
    )
    spec_before = await spec_metrics.read_counters(args.base_url, headers)
    results, duration = await run_requests(args, model, shares, headers)
    summary = summarize(results, duration)
    summary["client_processes"] = n
    summary["spec_decode"] = spec_metrics.summarize(
        spec_before, await spec_metrics.read_counters(args.base_url, headers)
    )
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key", "command", "bench_command")}
    config["request_rate"] = None if math.isinf(args.request_rate) else args.request_rate  # JSON has no inf
    config["api_key_set"] = bool(api_key)
    return {
        "benchmark": "serve",
        "date": datetime.date.today().isoformat(),
        "label": args.label,
        "machine": machine,
        "command": list(sys.argv),
        "server": {
            "base_url": args.base_url,
            "endpoint": args.endpoint,
            "model": model,
            "models": models.get("data") if isinstance(models, dict) else None,
        },
        "config": config,
        "results": summary,
        "requests": request_records(results, args.save_detailed),
    }


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Exit status 0 when at least one request succeeded, 1 when all failed (the report says why) or a client
    process failed (there is no report then)."""
    try:
        doc = asyncio.run(benchmark(args))
    except ClientProcessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.result_file:  # first: the numbers are kept even if printing fails (a closed pipe)
        os.makedirs(os.path.dirname(os.path.abspath(args.result_file)), exist_ok=True)
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    print_report(doc["results"], args.label)
    if args.result_file:
        print(f"wrote {args.result_file}")
    return 0 if doc["results"]["completed"] else 1


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`ember bench serve ...` under `ember`'s subcommands."""
    bench = subparsers.add_parser("bench", help="benchmark clients (serve: load a running OpenAI-compatible server)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser(
        "serve",
        help="measure TTFT, TPOT, ITL, latency and throughput of a running server",
        description=__doc__.split("\n\n")[0],
    )
    add_serve_bench_args(serve)
    serve.set_defaults(func=cmd_bench_serve)
    return bench


def main(argv: list[str] | None = None) -> int:
    """`python -m ember.bench.serve ...`, the same as `ember bench serve ...`."""
    parser = argparse.ArgumentParser(prog="ember bench serve", description=__doc__.split("\n\n")[0])
    add_serve_bench_args(parser)
    try:
        return cmd_bench_serve(parser.parse_args(argv))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
