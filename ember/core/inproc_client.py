"""The engine core in the front end's own process (`LLM`, `ember generate`, tests that patch the core).

`get_output` runs one iteration of the core's loop in the caller's thread, so an idle core costs
nothing and there is no second process to start, feed or watch.
"""

from __future__ import annotations

import logging

from ember.config import EngineConfig
from ember.core.engine_core import EngineCore
from ember.core.loop import CoreLoop
from ember.messages import CoreInput, CoreOutput, EngineCoreClient, EngineCoreFailed, EngineCoreReady

logger = logging.getLogger("ember")


class InprocClient(EngineCoreClient):
    """The core in this process; `get_output` runs one iteration of its loop in the caller's thread."""

    def __init__(self, config: EngineConfig) -> None:
        self.loop = CoreLoop(EngineCore(config))
        self.ready = self.loop.core.ready

    def wait_ready(self, timeout: float | None = None) -> EngineCoreReady:
        return self.ready

    def send(self, message: CoreInput) -> None:
        self.loop.put(message)

    def get_output(self, timeout: float | None = None) -> list[CoreOutput]:
        try:
            return self.loop.run_once(timeout)
        except BaseException as e:  # the core's loop failed: as fatal as a core process dying
            logger.exception("engine core stopped")
            self.failure = f"{type(e).__name__}: {e}"
            self.shutdown()
            return [EngineCoreFailed(self.failure)]

    def shutdown(self, timeout: float = 10.0) -> None:
        if not self.loop.stopped:
            self.loop.stopped = True
            self.loop.core.shutdown()
