"""`CoreLoop`: an `EngineCore` driven by a queue of input messages.

The core process's main thread runs it in a busy loop (`run`); the in-process client runs one
iteration at a time in its caller's thread (`run_once`). Either way the order is the same: take
every input waiting (blocking only while the core has nothing to do), then run one step.

`progress()` may be read from any thread: the core process's heartbeat reports it, so that the
front end can tell a long step from a loop stuck in one.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

from ember.core.engine_core import EngineCore
from ember.messages import AbortRequests, CoreInput, CoreOutput, EngineCoreRequest, UtilityCall, UtilityResult

logger = logging.getLogger("ember")
SHUTDOWN = "shutdown"  # the UtilityCall that ends the loop (after answering it)


class CoreLoop:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.inputs: queue.SimpleQueue[CoreInput] = queue.SimpleQueue()
        self.stopped = False
        self._idle_changed = False  # an input changed the core's state since the last outputs
        self.iterations = 0  # run_once calls begun: the current iteration's number
        self._busy_since = 0.0  # time.monotonic() when the current iteration got work; 0 while it waits

    def progress(self) -> tuple[int, float]:
        """(the current iteration's number, seconds it has been working: 0 while it waits for input)."""
        iterations, since = self.iterations, self._busy_since
        return iterations, 0.0 if since == 0.0 else max(0.0, time.monotonic() - since)

    def put(self, message: CoreInput) -> None:
        """Thread-safe: the caller's or an I/O thread."""
        self.inputs.put(message)

    def run_once(self, timeout: float | None = None) -> list[CoreOutput]:
        """Handle the waiting inputs (while the core is idle, waiting up to `timeout` seconds for one;
        None: until one comes), then step if there is work. An idle core whose requests were aborted
        reports fresh stats instead."""
        block = not self.core.has_work()
        self.iterations += 1
        self._busy_since = 0.0 if block else time.monotonic()
        results = self._take_inputs(block=block, timeout=timeout)
        if self.stopped:
            return results
        if self.core.has_work():
            results.append(self.core.step())
            self._idle_changed = False
        elif self._idle_changed:
            results.append(self.core.outputs())
            self._idle_changed = False
        return results

    def run(self, emit: Callable[[CoreOutput], None]) -> None:
        """Until a shutdown call: the core process's main thread."""
        while not self.stopped:
            for out in self.run_once(timeout=1.0):
                emit(out)

    def _take_inputs(self, block: bool, timeout: float | None) -> list[CoreOutput]:
        results: list[CoreOutput] = []
        try:
            message = self.inputs.get(timeout=timeout) if block else self.inputs.get_nowait()
        except queue.Empty:
            return results
        if block:  # woken by an input: working from now on
            self._busy_since = time.monotonic()
        while True:
            result = self._handle(message)
            if result is not None:
                results.append(result)
            try:
                message = self.inputs.get_nowait()
            except queue.Empty:
                return results

    def _handle(self, message: CoreInput) -> UtilityResult | None:
        self._idle_changed = True
        if isinstance(message, EngineCoreRequest):
            self.core.add_request(message)
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
        elif isinstance(message, UtilityCall):
            return self._call(message)
        return None

    def _call(self, call: UtilityCall) -> UtilityResult:
        if call.method == SHUTDOWN:
            self.core.shutdown()
            self.stopped = True
            return UtilityResult(call.call_id)
        if call.method not in EngineCore.UTILITIES:
            return UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}")
        try:
            return UtilityResult(call.call_id, getattr(self.core, call.method)(*call.args))
        except Exception as e:  # a utility's failure is the caller's answer, not the core's end
            logger.exception("utility call %s failed", call.method)
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")
