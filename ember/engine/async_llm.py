"""`AsyncLLM`: the engine for asyncio programs (the HTTP server, or any user service).

The engine runs in its own thread, so a step's compute never blocks the event loop. Requests are
tokenized and validated in the caller's task (errors surface there at once), then handed to the
engine thread through a command queue; each request's outputs come back through its own
asyncio queue. Cancelling the consuming task aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ember.config import EngineArgs
from ember.engine.engine import LLMEngine, PreparedRequest, PromptType
from ember.engine.metrics import PrometheusStatLogger
from ember.engine.output import RequestOutput
from ember.sampling.params import SamplingParams

logger = logging.getLogger("ember")


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_waiting_requests` already; retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an unexpected error; no request can run any more."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine; other requests are unaffected."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    # Outputs handed over by the engine thread / taken by the consumer: each counter has one writer.
    delivered: int = 0
    taken: int = 0

    @property
    def behind(self) -> bool:
        return self.delivered > self.taken


class AsyncLLM:
    def __init__(self, args: EngineArgs, max_waiting_requests: int | None = None,
                 served_model_name: str | None = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        self.engine = LLMEngine(args)
        self.served_model_name = served_model_name or args.served_model_name or str(args.model or "default")
        self.max_waiting_requests = max_waiting_requests
        self.metrics = PrometheusStatLogger(self.served_model_name)
        self.metrics_registry = self.metrics.registry
        self.engine.stat_loggers.append(self.metrics)
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._num_queued_adds = 0
        self._count_lock = threading.Lock()
        self._accepting = True
        self._stopping = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
        self._thread.start()

    # ---- what front ends read -------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def device(self):
        return self.engine.runner.device

    @property
    def num_blocks(self) -> int:
        return self.engine.block_manager.num_blocks

    @property
    def block_size(self) -> int:
        return self.engine.block_manager.block_size

    @property
    def max_concurrency(self) -> float:
        return self.engine.kv_capacity_tokens / self.engine.max_model_len

    @property
    def is_ready(self) -> bool:
        return self._accepting and self._dead is None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return self._num_queued_adds + len(self.engine.scheduler.waiting)

    def default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    # ---- requests -------------------------------------------------------------------------

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput each time the request makes progress; the last has `finished=True`."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead!r}")
        if not self._accepting:
            raise RuntimeError("the engine is shutting down and accepts no new requests")
        if self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting "
                                 f"(--max-waiting-requests {self.max_waiting_requests})")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Tokenizing a long prompt takes milliseconds: keep it off the event loop.
        prepared = await asyncio.to_thread(self.engine.make_request, request_id, prompt, sampling_params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._send("add", prepared)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                stream.taken += 1
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send("abort", request_id)

    async def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, let running requests finish for up to `timeout` seconds, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.05)
        self._stopping = True
        self._send("abort_all", None)
        await asyncio.to_thread(self._thread.join, max(deadline - time.monotonic(), 0) + 5.0)
        self.engine.shutdown()

    # ---- engine thread --------------------------------------------------------------------

    def _send(self, command: str, arg: Any) -> None:
        if command == "add":
            with self._count_lock:
                self._num_queued_adds += 1
        self._commands.put((command, arg))
        self._wake.set()

    def _run(self) -> None:
        try:
            while True:
                self._drain_commands()
                if self._stopping and not self.engine.has_unfinished_requests():
                    return
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                self._dispatch(self.engine.step(defer=self._consumer_behind))
        except BaseException as e:  # an engine bug: fail every stream instead of hanging them
            logger.exception("engine loop died")
            self._dead = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"the engine stopped: {e!r}"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                with self._count_lock:
                    self._num_queued_adds -= 1
                self._add(arg)
            elif command == "abort":
                self._dispatch(self.engine.abort_request(arg))
            elif command == "abort_all":
                self._dispatch(self.engine.abort_request(self.engine.unfinished_request_ids()))

    def _add(self, prepared: PreparedRequest) -> None:
        if prepared.request_id not in self._streams:  # cancelled before the engine saw it
            return
        try:
            self.engine.add_prepared(prepared)
        except ValueError as e:
            self._deliver(prepared.request_id, e)

    def _consumer_behind(self, request_id: str) -> bool:
        """While a stream's consumer has not taken its last output, the engine makes no new one for it:
        the next carries both steps' deltas. Under load (hundreds of streams, the event loop busy
        writing chunks) fewer outputs are built and sent instead of queueing up (on the H200 serving
        benchmark it measured the same throughput as joining queued outputs on the consumer's side)."""
        stream = self._streams.get(request_id)
        return stream is not None and stream.behind

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        self._deliver_all([(out.request_id, RequestFailedError(out.error) if out.error else out) for out in outputs])

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """One wake-up per event loop for a whole step's outputs, not one per request (hundreds per step
        at full batch, each a write to the loop's self-pipe and a callback)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.delivered += 1
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, pairs)
            except RuntimeError:  # the caller's event loop is closed; nobody is listening
                pass


def _put_all(pairs: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in pairs:
        q.put_nowait(item)
