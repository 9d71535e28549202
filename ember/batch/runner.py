"""Running a batch: every line at once up to a bound on requests in flight, retries, and a resumable output.

The runner is the same for the engine in this process and for a server over HTTP: it calls a
`Target` (local.py, remote.py) with a line's url and body and gets a `Reply`. What it owns:

- Concurrency: all lines are queued at once and up to `max_concurrency` are in flight, so the
  engine's scheduler always has a full batch to choose from (vLLM's run-batch keeps twice
  `max_num_seqs` in flight; so do we by default). A request waiting out a retry delay holds no slot.
- Retries: a reply with status 408, 429 or 5xx (the engine failed, the server is busy, loading or
  draining) and no reply at all (connection refused or dropped, `request_timeout` passed) are
  transient and retried up to `max_retries` times after `retry_delay * 2**attempt` seconds (times
  1 to 1.25 at random, so a burst of 429s does not come back as one burst; never less than a
  `Retry-After` the server sent). Any other 4xx says the request itself is wrong, and retrying it
  cannot help: it is written at once. A target may raise `BatchAborted` (the engine in this process
  died): the job stops, and what it had not written runs on the next run.
- Output: each record is written and flushed as its request finishes (in finishing order, not input
  order), so `kill -9` loses only the requests in flight; a rerun with the same output file skips
  every line it already answers (records.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from tqdm.auto import tqdm

from ember.batch.records import BatchLine, LineError, error_record, parse_line, read_done, success_record

RETRYABLE_STATUSES = frozenset({408, 429})
_JITTER = 0.25


@dataclass(frozen=True)
class Reply:
    """A target's answer: an HTTP status and JSON body, or status 0 when no answer came (`code` and
    `message` then say why)."""

    status: int
    body: dict[str, Any] | None = None
    retry_after: float | None = None
    code: str | None = None
    message: str | None = None

    @property
    def retryable(self) -> bool:
        return self.status == 0 or self.status in RETRYABLE_STATUSES or self.status >= 500


Target = Callable[[str, dict[str, Any]], Awaitable[Reply]]


class BatchAborted(Exception):
    """The target can answer nothing more (its engine died): stop, keeping what is written."""


@dataclass(frozen=True)
class BatchOptions:
    max_concurrency: int = 512
    max_retries: int = 3
    retry_delay: float = 1.0
    request_timeout: float | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        for name, value, low in (("max_concurrency", self.max_concurrency, 1), ("max_retries", self.max_retries, 0)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if self.retry_delay < 0:
            raise ValueError(f"retry_delay must be >= 0, got {self.retry_delay}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}")


@dataclass
class BatchSummary:
    total: int = 0  # input lines
    skipped: int = 0  # already answered by an earlier run
    succeeded: int = 0
    failed: int = 0
    retries: int = 0
    output_tokens: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        rate = self.output_tokens / self.seconds if self.seconds else 0.0
        return (
            f"{self.total} lines: {self.succeeded} succeeded, {self.failed} failed, {self.skipped} already done; "
            f"{self.retries} retries; {self.output_tokens} output tokens in {self.seconds:.1f}s "
            f"({rate:.1f} tok/s)"
        )


Requests = str | os.PathLike[str] | Sequence[str | dict[str, Any]]


def numbered_lines(requests: Requests) -> list[tuple[int, str | dict[str, Any]]]:
    """(line number, line) for a JSONL file (blank lines skipped, numbers kept) or a list of requests."""
    if isinstance(requests, (str, os.PathLike)):
        with open(requests, encoding="utf-8") as f:
            return [(n, text) for n, text in enumerate(f, 1) if text.strip()]
    return list(enumerate(requests, 1))


class BatchRunner:
    def __init__(self, target: Target, output_path: str | os.PathLike[str], options: BatchOptions) -> None:
        self.target = target
        self.output_path = output_path
        self.options = options
        self.summary = BatchSummary()
        self._slots = asyncio.Semaphore(options.max_concurrency)
        self._out: IO[str] | None = None
        self._bar: Any = None
        self._start = 0.0

    async def run(self, requests: Requests) -> BatchSummary:
        done = read_done(self.output_path)
        items = _check_unique([parse_line(n, raw) for n, raw in numbered_lines(requests)])
        self.summary.total = len(items)
        todo = [item for item in items if not done.covers(item)]
        self.summary.skipped = len(items) - len(todo)
        self._start = time.monotonic()
        with (
            open(self.output_path, "a", encoding="utf-8") as self._out,  # noqa: ASYNC230 - once per batch, append-only
            tqdm(
                total=len(todo), desc="Running batch", unit="req", dynamic_ncols=True, disable=not self.options.progress
            ) as self._bar,
        ):
            for item in todo:
                if isinstance(item, LineError):
                    self._write(error_record(item.custom_id, item.line, item.code, item.message), item.message)
            await _run_all([self._run_line(item) for item in todo if isinstance(item, BatchLine)])
        self.summary.seconds = time.monotonic() - self._start
        return self.summary

    async def _run_line(self, item: BatchLine) -> None:
        for attempt in range(self.options.max_retries + 1):
            async with self._slots:
                reply = await self._attempt(item)
            if not reply.retryable or attempt == self.options.max_retries:
                break
            self.summary.retries += 1
            await asyncio.sleep(self._delay(attempt, reply))
        self._finish(item, reply)

    async def _attempt(self, item: BatchLine) -> Reply:
        try:
            return await asyncio.wait_for(self.target(item.url, item.body), self.options.request_timeout)
        except asyncio.TimeoutError:
            return Reply(0, code="timeout", message=f"no answer within {self.options.request_timeout:g}s")

    def _delay(self, attempt: int, reply: Reply) -> float:
        delay = self.options.retry_delay * 2**attempt * (1 + _JITTER * random.random())
        return max(delay, reply.retry_after or 0.0)

    def _finish(self, item: BatchLine, reply: Reply) -> None:
        if reply.status == 200 and reply.body is not None:
            usage = reply.body.get("usage") or {}
            self.summary.output_tokens += usage.get("completion_tokens") or 0
            self._write(success_record(item.custom_id, reply.body))
            return
        code, message = _error_fields(reply)
        where = f"line {item.line} (custom_id {item.custom_id!r})"
        status = reply.status or None
        self._write(
            error_record(item.custom_id, item.line, code, message, status, reply.body),
            f"{where}: {f'HTTP {status}: ' if status else ''}{message}",
        )

    def _write(self, record: dict[str, Any], error: str | None = None) -> None:
        """One whole line per write, flushed: a killed run leaves at most one unfinished line."""
        assert self._out is not None
        self._out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._out.flush()
        if error is None:
            self.summary.succeeded += 1
        else:
            self.summary.failed += 1
            tqdm.write(f"error: {error}", file=sys.stderr)
        elapsed = time.monotonic() - self._start
        self._bar.set_postfix_str(f"output: {self.summary.output_tokens / max(elapsed, 1e-9):.1f} tok/s", refresh=False)
        self._bar.update(1)


def _check_unique(items: list[BatchLine | LineError]) -> list[BatchLine | LineError]:
    """A custom_id's second line (and later ones) becomes an error: outputs are matched by custom_id."""
    first: dict[str, int] = {}
    checked: list[BatchLine | LineError] = []
    for item in items:
        if isinstance(item, BatchLine) and item.custom_id in first:
            item = LineError(
                item.line,
                item.custom_id,
                "duplicate_custom_id",
                f"line {item.line}: custom_id {item.custom_id!r} is already used on line {first[item.custom_id]}",
            )
        elif isinstance(item, BatchLine):
            first[item.custom_id] = item.line
        checked.append(item)
    return checked


def _error_fields(reply: Reply) -> tuple[str, str]:
    """`code` and `message` of a failed reply: OpenAI's error object if the body has one."""
    if reply.status == 0:
        return reply.code or "request_failed", reply.message or "no answer"
    error = (reply.body or {}).get("error")
    if isinstance(error, dict):
        return str(error.get("code") or error.get("type") or reply.status), str(error.get("message", ""))
    return str(reply.status), json.dumps(reply.body)[:300]


async def _run_all(coroutines: Iterable[Awaitable[None]]) -> None:
    """Run all; on the first exception (BatchAborted, Ctrl-C) cancel the rest, whose requests then abort."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
