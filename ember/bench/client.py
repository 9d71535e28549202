"""One client of `ember bench serve`: an asyncio loop that sends its share of the requests at their arrival times.

`--num-clients 1` runs it in the benchmark's own process; `ember.bench.processes` runs one per client process,
each over the requests dealt to it, from one common start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ember.bench.report import RequestResult
from ember.bench.workloads import RequestSpec, request_body
from ember.http_client import APIS, Api, HTTPStatusError, StreamError, stream_completion


@dataclass
class Share:
    """What one client sends: requests, their arrival times (seconds after the start), its cap on those in flight."""

    specs: Sequence[RequestSpec]
    times: Sequence[float]
    max_concurrency: int | None


async def send_request(
    url: str, body: dict[str, Any], headers: dict[str, str], api: Api, spec: RequestSpec, timeout: float, t0: float
) -> RequestResult:
    """Never raises for a failed request: the failure is recorded in the result."""
    res = RequestResult(spec.prompt_len, spec.output_len)
    start = time.perf_counter()
    res.start_s = start - t0
    try:
        await asyncio.wait_for(stream_completion(url, body, headers, api, res, start), timeout)
    except asyncio.TimeoutError:  # before OSError: it is one since Python 3.11
        res.error = f"timed out after {timeout:g} s"
    except (HTTPStatusError, StreamError) as e:
        res.error = str(e)
    except Exception as e:  # noqa: BLE001 - refused or dropped connections, bad bytes, odd JSON: one failure each
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    res.end_s = time.perf_counter() - t0
    res.success = res.error is None
    return res


async def send_share(
    args: argparse.Namespace, model: str, share: Share, headers: dict[str, str], t0: float, progress: bool
) -> tuple[list[RequestResult], float]:
    """Each request of `share` at `t0` (a `time.perf_counter` instant, maybe still to come) plus its arrival time;
    returns the results in the share's order and the instant the last one ended."""
    url = args.base_url.rstrip("/") + args.endpoint
    api = APIS[args.endpoint]
    limit = asyncio.Semaphore(share.max_concurrency) if share.max_concurrency else None
    _raise_open_files_limit(min(len(share.specs), share.max_concurrency or len(share.specs)) + 64)
    bar = _progress(len(share.specs)) if progress else None

    async def one(spec: RequestSpec) -> RequestResult:
        body = request_body(args, model, spec)
        async with limit if limit is not None else contextlib.nullcontext():
            res = await send_request(url, body, headers, api, spec, args.request_timeout, t0)
        if bar is not None:
            bar.update(1)
        return res

    tasks = []
    try:
        for spec, at in zip(share.specs, share.times):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec)))
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        if bar is not None:
            bar.close()
    return list(results), time.perf_counter()


def _progress(total: int) -> Any:
    if not sys.stderr.isatty():
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
