"""The serving workload through the `openai` package's async client, as a typical user would send it.

`ember bench serve` uses its own small HTTP client; this sends the same requests with
`openai.AsyncOpenAI` (streaming completions, all at once), so the two can be read side by side and a
client's own cost shows: the SDK parses every chunk into pydantic objects on the same event loop that
times them. The requests are `ember bench serve`'s, built by its code (`make_requests`, whose nano-vllm
dataset is `ember.bench.workloads`, and `request_body`): token-id prompts to /v1/completions,
`max_tokens` per request, temperature 0.6, `stream=True` with `stream_options={"include_usage": True}`;
what the SDK has no parameter for (`ignore_eos`, `--extra-body`) goes in `extra_body`.

    ember serve benchmarks/configs/qwen3-0.6b --load-format dummy &
    python benchmarks/openai_client.py --base-url http://127.0.0.1:8000
    python benchmarks/openai_client.py --base-url http://127.0.0.1:8000 --num-prompts 8 --dataset random \\
        --random-input-len 32 --random-output-len 16                                   # quick

The metrics are `ember bench serve`'s (its `summarize`): TTFT is the first chunk carrying output by
its rule (text, or a chunk before the finish for tokens whose text is not out yet: a model without a
tokenizer, random weights), which on Ember is the first chunk of the stream; `ttft_text` is the first
chunk with non-empty text, reported beside it (null for a request that streamed no text).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, today, write_json
from benchmarks.throughput import model_short_name
from ember.bench.flags import add_serve_bench_args, check_args
from ember.bench.machine import client_machine_info
from ember.bench.report import RequestResult, distribution, print_report, request_records, summarize
from ember.bench.workloads import RequestSpec, make_requests, request_body
from ember.http_client import COMPLETIONS

# `client.completions.create`'s own parameters among the body's keys; the rest goes in `extra_body`
SDK_PARAMS = ("model", "prompt", "max_tokens", "temperature", "stream", "stream_options")
# flags of `ember bench serve` this script has no use for: completions only, all requests at once from this one
# process (the SDK's cost is what it shows), --out, no bar
OMITTED = ("--endpoint", "--request-rate", "--max-concurrency", "--num-clients", "--result-file", "--disable-tqdm")


def import_openai() -> Any:
    """Imported on use: `--help` works without the package, and its absence gets a plain message."""
    try:
        import openai
    except ImportError:
        raise SystemExit("error: this benchmark needs the openai package (pip install openai)") from None
    return openai


def make_client(openai: Any, args: argparse.Namespace, connections: int) -> Any:
    """No retries: a retried request would hide its failure and count the retry's wait as latency. A pool of at least
    one connection per request: every streaming request holds its connection to the end, so a smaller pool (the
    SDK's default size depends on its version) would queue the rest inside the client, and that wait would show
    as the server's TTFT. The SDK's timeout is per read; `--request-timeout` also bounds each whole request."""
    import httpx

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return openai.AsyncOpenAI(
        base_url=args.base_url.rstrip("/") + "/v1",
        max_retries=0,
        timeout=args.request_timeout,
        api_key=args.api_key or os.environ.get("EMBER_API_KEY") or "EMPTY",
        http_client=openai.DefaultAsyncHttpxClient(limits=limits),
    )


async def served_model(openai: Any, client: Any, args: argparse.Namespace) -> str:
    if args.model is not None:
        return args.model
    try:
        return (await client.models.list()).data[0].id
    except (openai.APIError, IndexError) as e:
        raise SystemExit(
            f"error: cannot list the models at {args.base_url} ({type(e).__name__}: {e}); "
            "is the server up? or pass --model"
        ) from None


def sdk_arguments(body: dict[str, Any]) -> dict[str, Any]:
    """`ember bench serve`'s request body as `completions.create` keywords."""
    named = {k: v for k, v in body.items() if k in SDK_PARAMS}
    extra = {k: v for k, v in body.items() if k not in SDK_PARAMS}
    return {**named, "extra_body": extra or None}


async def stream_one(client: Any, body: dict[str, Any], res: RequestResult, start: float) -> float | None:
    """Fills `res` as `ember bench serve` does; returns seconds to the first chunk with text (None: no text)."""
    first_text = None
    finished = False
    async with await client.completions.create(**sdk_arguments(body)) as stream:
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                res.prompt_tokens, res.output_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.text or choice.finish_reason is None:  # carries output, by ember bench serve's rule
                    res.output_chunk(now, start)
                if choice.text and first_text is None:
                    first_text = now - start
                if choice.finish_reason is not None:
                    finished = True
                    res.finish(now, start)
    res.e2e = time.perf_counter() - start
    if not finished:
        raise RuntimeError("stream ended without a finish_reason")
    if res.output_tokens is None:
        res.output_tokens = res.text_chunks
    res.success = True
    return first_text


async def send(
    openai: Any, client: Any, body: dict[str, Any], spec: RequestSpec, timeout: float, t0: float
) -> tuple[RequestResult, float | None]:
    """Never raises for a failed request; errors read like `ember bench serve`'s, so they group alike."""
    res = RequestResult(spec.prompt_len, spec.output_len)
    start = time.perf_counter()
    res.start_s = start - t0
    first_text = None
    try:
        first_text = await asyncio.wait_for(stream_one(client, body, res, start), timeout)
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout:g} s"
    except openai.APIStatusError as e:
        res.error = f"HTTP {e.status_code}: {e.message}"
    except Exception as e:  # noqa: BLE001 - refused or dropped connections, bad chunks: one failure each
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    res.end_s = time.perf_counter() - t0
    if res.error is not None:
        res.success = False
    return res, first_text


async def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """Every request at once; returns the summary, the per-request records and the model."""
    openai = import_openai()
    specs = make_requests(args)
    async with make_client(openai, args, len(specs)) as client:
        model = await served_model(openai, client, args)
        bodies = [request_body(args, model, spec) for spec in specs]
        print(
            f"{len(specs)} requests to {args.base_url.rstrip('/')}/v1/completions (model {model}) through "
            f"openai.AsyncOpenAI {openai.__version__}, all at once",
            flush=True,
        )
        t0 = time.perf_counter()
        pairs = await asyncio.gather(
            *(send(openai, client, body, spec, args.request_timeout, t0) for body, spec in zip(bodies, specs))
        )
        duration = time.perf_counter() - t0
    results = [res for res, _ in pairs]
    text_times = [t for res, t in pairs if res.success and t is not None]
    summary = summarize(results, duration)
    summary.update(
        {f"{stat}_ttft_text_ms": v for stat, v in distribution(text_times).items()}, requests_with_text=len(text_times)
    )
    records = request_records(results, args.save_detailed)
    for record, (_, t) in zip(records, pairs):
        record["ttft_text_ms"] = None if t is None else round(t * 1e3, 3)
    return summary, records, model


def client_versions() -> dict[str, str]:
    import httpx

    return {"openai": import_openai().__version__, "httpx": httpx.__version__}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The other flags are `ember bench serve`'s; the requests go to /v1/completions, all at once.",
    )
    add_serve_bench_args(p, omit=OMITTED)
    p.set_defaults(dataset="nano-vllm", num_prompts=256, temperature=0.6, endpoint=COMPLETIONS, max_concurrency=None)
    p.add_argument(
        "--out", default=None, help="JSON path (default: benchmarks/results/openai-client-<model>-<date>.json)"
    )
    args = p.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = client_machine_info()  # the client's; the server may run elsewhere
    summary, records, model = asyncio.run(run(args))
    print_report(summary, args.label or "openai.AsyncOpenAI")
    print(
        f"TTFT to the first text chunk (ms): median {summary['median_ttft_text_ms']}, p99 "
        f"{summary['p99_ttft_text_ms']}; {summary['requests_with_text']} of {summary['completed']} requests "
        "streamed text"
    )
    out = args.out or os.path.join(RESULTS_DIR, f"openai-client-{model_short_name(model)}-{today()}.json")
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    config.update(
        model_served=model,
        api_key_set=bool(args.api_key or os.environ.get("EMBER_API_KEY")),
        max_connections=args.num_prompts,
        max_retries=0,
        **client_versions(),
    )
    server = {"base_url": args.base_url, "endpoint": COMPLETIONS, "model": model}
    write_json(
        out,
        {
            "benchmark": "openai-client",
            "date": today(),
            "label": args.label,
            "machine": machine,
            "command": sys.argv,
            "server": server,
            "config": config,
            "results": summary,
            "requests": records,
        },
    )
    print(f"wrote {out}")
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
