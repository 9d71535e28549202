"""`ember run-batch -i requests.jsonl -o results.jsonl`: an OpenAI Batch API file through the engine.

It takes `ember serve`'s flags (the same parser, so engine flags, `--served-model-name`,
`--max-waiting-requests` and `--config` mean what they mean there; `--host`, `--port` and the
shutdown and body-size options have nothing to do), plus the batch options below. With `--url` it
loads no model and sends each line to that server instead (with `--api-key` as its key). Exit code
0 when every line has a record (failed lines included), 1 when the job stopped early (the engine
died; a rerun continues), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import TYPE_CHECKING, Any

from ember.config import EngineArgs
from ember.server.args import ServerSettings, add_serve_args, resolve_args, settings_from_args

if TYPE_CHECKING:
    from ember.batch.runner import BatchOptions, BatchSummary


def add_run_batch_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("run-batch", help="run an OpenAI Batch API file (JSONL) on the engine or a server")
    g = p.add_argument_group("batch")
    g.add_argument("-i", "--input-file", required=True, help="JSONL, one {custom_id, method, url, body} a line")
    g.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="JSONL results; lines it already answers are skipped, so a rerun resumes",
    )
    g.add_argument("--url", default=None, help="send the lines to this running server instead of loading a model")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight (default: 2 x --max-num-seqs)")
    g.add_argument("--max-retries", type=int, default=3, help="retries of a line after a 408, 429, 5xx or no answer")
    g.add_argument(
        "--retry-delay", type=float, default=1.0, help="seconds before the first retry, doubling for each next one"
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds one attempt may take before it counts as failed (default: no limit)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_serve_args(p)
    p.set_defaults(func=cmd_run_batch)
    return p


def cmd_run_batch(ns: argparse.Namespace) -> int:
    ns = resolve_args(ns)
    args, settings = settings_from_args(ns)
    if not os.path.isfile(ns.input_file):  # before a model load, not after
        raise ValueError(f"--input-file {ns.input_file}: no such file")
    from ember.batch.runner import BatchAborted, BatchOptions

    options = BatchOptions(
        max_concurrency=ns.max_concurrency or 2 * args.max_num_seqs,
        max_retries=ns.max_retries,
        retry_delay=ns.retry_delay,
        request_timeout=ns.request_timeout,
        progress=not ns.no_progress,
    )
    try:
        if ns.url is not None:
            from ember.batch.remote import ServerTarget
            from ember.batch.runner import BatchRunner

            key = settings.api_keys[0] if settings.api_keys else None
            runner = BatchRunner(ServerTarget(ns.url, key), ns.output_file, options)
            summary = asyncio.run(runner.run(ns.input_file))
        else:
            summary = _run_local(ns, args, settings, options)
    except BatchAborted as e:
        print(f"error: {e}; rerun the same command to finish the job", file=sys.stderr)
        return 1
    print(summary.describe(), file=sys.stderr)
    return 0


def _run_local(
    ns: argparse.Namespace, args: EngineArgs, settings: ServerSettings, options: BatchOptions
) -> BatchSummary:
    from ember.batch.local import run_on_engine
    from ember.frontend.async_llm import AsyncLLM

    engine = AsyncLLM(args, max_waiting_requests=ns.max_waiting_requests, served_model_name=settings.model_name)

    async def run() -> BatchSummary:
        try:
            return await run_on_engine(engine, settings, ns.input_file, ns.output_file, options)
        finally:
            await engine.shutdown(timeout=0)

    return asyncio.run(run())
