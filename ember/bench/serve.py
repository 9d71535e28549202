"""`ember bench serve`: a serving benchmark client for any OpenAI-compatible server.

It sends `--num-prompts` streaming requests to a running server (Ember, vLLM, llama.cpp's server,
...) with Poisson arrivals at `--request-rate` (or all at once), optionally capped at
`--max-concurrency` requests in flight, and reports what a user of the server sees. The metric
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
`ember.bench.report` computes the metrics and `ember.bench.flags` defines the flags; this module sends
the requests at their arrival times and assembles the result document.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ember.bench import spec_metrics
from ember.bench.flags import add_serve_bench_args, check_args
from ember.bench.machine import client_machine_info
from ember.bench.report import RequestResult, print_report, request_records, summarize
from ember.bench.workloads import RequestSpec, arrival_times, make_requests, request_body
from ember.http_client import APIS, Api, HTTPStatusError, ProtocolError, StreamError, get_json, stream_completion


class InFlight:
    """Counts the requests in flight and the most at once: what a run actually reached, whatever its cap."""

    def __init__(self) -> None:
        self.now = self.max = 0

    @contextlib.contextmanager
    def track(self) -> Any:
        self.now += 1
        self.max = max(self.max, self.now)
        try:
            yield
        finally:
            self.now -= 1


async def send_request(
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    api: Api,
    spec: RequestSpec,
    timeout: float,
    t0: float,
    in_flight: InFlight,
) -> RequestResult:
    """Never raises for a failed request: the failure is recorded in the result."""
    res = RequestResult(spec.prompt_len, spec.output_len)
    start = time.perf_counter()
    res.start_s = start - t0
    with in_flight.track():
        try:
            await asyncio.wait_for(stream_completion(url, body, headers, api, res, start), timeout)
        except asyncio.TimeoutError:  # before OSError: it is one since Python 3.11
            res.error = f"timed out after {timeout:g} s"
        except (HTTPStatusError, StreamError) as e:
            res.error = str(e)
        except Exception as e:  # noqa: BLE001 - refused or dropped connections, bad bytes, odd JSON: one failure each
            res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    res.success = res.error is None
    return res


async def run_requests(
    args: argparse.Namespace, model: str, specs: Sequence[RequestSpec], headers: dict[str, str]
) -> tuple[list[RequestResult], float, int]:
    """All requests at their arrival times; returns the results, the duration and the most requests in flight."""
    url = args.base_url.rstrip("/") + args.endpoint
    api = APIS[args.endpoint]
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    in_flight = InFlight()
    progress = _progress(len(specs), args.disable_tqdm)

    async def one(spec: RequestSpec) -> RequestResult:
        body = request_body(args, model, spec)
        async with limit if limit is not None else contextlib.nullcontext():
            res = await send_request(url, body, headers, api, spec, args.request_timeout, t0, in_flight)
        if progress is not None:
            progress.update(1)
        return res

    times = arrival_times(len(specs), args.request_rate, args.seed)
    tasks = []
    t0 = time.perf_counter()
    try:
        for spec, at in zip(specs, times):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec)))
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        if progress is not None:
            progress.close()
    return list(results), time.perf_counter() - t0, in_flight.max


def _progress(total: int, disable: bool) -> Any:
    if disable or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req")


def _raise_open_files_limit(needed: int) -> None:
    """One connection per request in flight: lift the soft descriptor limit towards the hard one if needed."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):
        pass


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
    _raise_open_files_limit(min(len(specs), args.max_concurrency or len(specs)) + 64)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
    print(
        f"{len(specs)} requests to {args.base_url.rstrip('/')}{args.endpoint} (model {model}), request rate "
        f"{rate}, max concurrency {args.max_concurrency or 'unlimited'}",
        flush=True,
    )
    spec_before = await spec_metrics.read_counters(args.base_url, headers)
    results, duration, max_in_flight = await run_requests(args, model, specs, headers)
    summary = summarize(results, duration, max_in_flight)
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
    """Exit status 0 when at least one request succeeded, 1 when all failed (the report says why)."""
    doc = asyncio.run(benchmark(args))
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
