"""`ember bench serve --num-clients N`: the client in N processes, so that the client never sets the pace.

One Python process parses every chunk of every stream on one core: with 256 streams at once on an H200
(2026-12-04) `ember bench serve` measured TTFT p99 1.07 s and 0.93 of offline throughput where 8 client
processes measured 0.26 s and 1.02, against the same server. So the work is spread out, not the workload:
the parent draws the requests and their arrival times once, as for one process, and deals them round-robin
(process k sends requests k, k + N, ...); a --max-concurrency cap is split as evenly as possible, each process
capping its own share. The processes are spawned (no fork of a process with threads), each says when it is
ready, then all get one start instant on `time.perf_counter`'s clock (CLOCK_MONOTONIC, one for the whole
machine), so a burst leaves at once. Each sends back its `RequestResult`s (plain dataclasses, pickled through
its pipe) and when its last request ended; the parent puts them back in request order and computes every
metric as for one process. A process that fails or dies raises `ClientProcessError` at once; the parent's
Ctrl-C or exception stops them all, and each ends by itself when the parent dies, however it dies.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from ember.bench.client import Share, send_share
from ember.bench.report import RequestResult
from ember.bench.workloads import RequestSpec

START_LEAD_S = 0.1  # from sending the start instant to the start: every process is waiting for it by then
_STOP_WAIT_S = 5.0
_READY, _DONE, _FAILED = "ready", "done", "failed"


class ClientProcessError(RuntimeError):
    """A client process failed or died: its requests' results are lost, so the run has none to report."""


@dataclass
class _Worker:
    index: int
    process: BaseProcess
    conn: multiprocessing.connection.Connection


def num_processes(requested: int, requests: int, max_concurrency: int | None) -> int:
    """--num-clients, but never more processes than requests, nor than requests allowed in flight."""
    return max(1, min(requested, requests, max_concurrency or requests))


def deal(specs: Sequence[RequestSpec], times: Sequence[float], max_concurrency: int | None, n: int) -> list[Share]:
    """Round-robin: client k sends requests k, k + n, ... at their own arrival times; the first
    `max_concurrency % n` clients may have one more in flight than the others."""
    return [
        Share(
            specs[k::n],
            times[k::n],
            None if max_concurrency is None else max_concurrency // n + (k < max_concurrency % n),
        )
        for k in range(n)
    ]


async def run_in_processes(
    args: argparse.Namespace, model: str, shares: Sequence[Share], headers: dict[str, str]
) -> tuple[list[RequestResult], float]:
    """Every share in its own process from one start; returns the results in request order and the duration."""
    ctx = multiprocessing.get_context("spawn")
    workers: list[_Worker] = []
    try:
        for k, share in enumerate(shares):
            workers.append(_start(ctx, k, args, model, share, headers))
        await asyncio.to_thread(_collect, workers, _READY)
        t0 = time.perf_counter() + START_LEAD_S
        for w in workers:
            w.conn.send(t0)
        done = await asyncio.to_thread(_collect, workers, _DONE)
    finally:
        _stop(workers)
    return _in_request_order([results for results, _ in done]), max(end for _, end in done) - t0


def _start(
    ctx: multiprocessing.context.SpawnContext,
    k: int,
    args: argparse.Namespace,
    model: str,
    share: Share,
    headers: dict[str, str],
) -> _Worker:
    conn, child_conn = ctx.Pipe()
    process = ctx.Process(
        target=_client_process,
        args=(child_conn, args, model, share, headers),
        name=f"ember-bench-client{k}",
        daemon=True,
    )
    process.start()
    child_conn.close()  # the child's end lives in the child only: its death reads as EOF here
    return _Worker(k, process, conn)


def _collect(workers: Sequence[_Worker], kind: str) -> list[Any]:
    """One `kind` message from every worker, in their order; raises as soon as one fails or ends without it."""
    got: dict[int, Any] = {}
    while len(got) < len(workers):
        waiting = [w for w in workers if w.index not in got]
        ready = multiprocessing.connection.wait([w.conn for w in waiting] + [w.process.sentinel for w in waiting])
        for w in waiting:
            if w.conn in ready:  # before the sentinel: a worker that sent its results may have ended since
                got[w.index] = _receive(w, kind)
            elif w.process.sentinel in ready:
                raise _died(w)
    return [got[w.index] for w in workers]


def _receive(w: _Worker, kind: str) -> Any:
    try:
        tag, payload = w.conn.recv()
    except (EOFError, OSError):
        raise _died(w) from None
    if tag == _FAILED:
        raise ClientProcessError(f"client process {w.index} failed:\n{payload}")
    assert tag == kind, (tag, kind)
    return payload


def _died(w: _Worker) -> ClientProcessError:
    w.process.join(_STOP_WAIT_S)
    return ClientProcessError(
        f"client process {w.index} (pid {w.process.pid}) exited with code {w.process.exitcode} before it was done"
    )


def _stop(workers: Sequence[_Worker]) -> None:
    """Done or not, every worker ends: those still running are terminated, then killed if they linger."""
    for w in workers:
        if w.process.is_alive():
            w.process.terminate()
    for w in workers:
        w.process.join(_STOP_WAIT_S)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.conn.close()


def _in_request_order(per_share: Sequence[list[RequestResult]]) -> list[RequestResult]:
    """`deal` undone: request i is share i % n's (i // n)-th."""
    n = len(per_share)
    return [per_share[i % n][i // n] for i in range(sum(len(r) for r in per_share))]


def _client_process(
    conn: multiprocessing.connection.Connection,
    args: argparse.Namespace,
    model: str,
    share: Share,
    headers: dict[str, str],
) -> None:
    """One client process: ready, then its share from the start instant the parent sends, then its results."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops us
    threading.Thread(target=_exit_with_parent, name="ember-bench-parent", daemon=True).start()
    try:
        conn.send((_READY, None))
        t0 = conn.recv()
        done = asyncio.run(send_share(args, model, share, headers, t0, progress=False))
    except BaseException:  # noqa: BLE001 - whatever it is, the parent reports it; the exit status says so too
        conn.send((_FAILED, traceback.format_exc()))
        sys.exit(1)
    conn.send((_DONE, done))


def _exit_with_parent() -> None:
    """A client process ends as soon as the benchmark's does, however it ended (kill -9 included)."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)
