"""`ember serve`'s server: uvicorn with Ember's drain, the engine loaded beside it.

The engine core's process is started first (`ember.server.launch` does it before this module's web
stack is imported), so it imports torch and loads the model while this process imports FastAPI,
binds the port and loads the tokenizer; `/health` answers 503 until the core is ready, and
orchestrators can tell "starting" from "dead". On SIGTERM/SIGINT the server keeps its socket
open but answers 503 to new work while running requests finish (up to `--shutdown-timeout`),
then stops the core and exits 0; a second signal stops at once. If the core dies, running
streams end with an error event, `/health` and new requests get 503, and after
`_DEAD_ENGINE_GRACE_S` the server exits 1 so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator

import uvicorn

from ember import heap, timeline
from ember.config import EngineArgs
from ember.frontend.async_llm import AsyncLLM
from ember.frontend.core_client import EngineCoreClient
from ember.logger import route_server_logs
from ember.server.app import ServerState, build_app
from ember.server.args import ServerSettings

logger = logging.getLogger("ember")

# Enough for finished streams to write their last bytes; the real wait is `--shutdown-timeout`.
_CONNECTION_CLOSE_GRACE_S = 5  # an int: uvicorn's Config takes whole seconds
# After the core died: long enough for running streams to send their error event and for health
# checks to see 503, short enough for a supervisor to restart the service promptly.
_DEAD_ENGINE_GRACE_S = 2.0


def run_server(
    ns: argparse.Namespace, sock: socket.socket, args: EngineArgs, settings: ServerSettings, client: EngineCoreClient
) -> int:
    """Serve on `sock` (bound by `ember.server.launch`) until stopped."""
    try:
        return asyncio.run(_serve(ns, sock, args, settings, client))
    finally:
        sock.close()
        client.shutdown()


class _Server(uvicorn.Server):
    """uvicorn, with Ember's drain on SIGTERM/SIGINT.

    Plain uvicorn closes the listening socket at once (so nobody could see /health turn 503) and
    re-raises the signal after its shutdown, which makes a clean stop exit 143 instead of 0.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self.watchdog: asyncio.Task[None] | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        timeline.mark("HTTP listening")

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self._drain_task is not None:
            logger.warning("second %s: stopping now", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        logger.info(
            "%s: refusing new requests; running ones get up to %gs to finish",
            signal.Signals(sig).name,
            self.state.settings.shutdown_timeout,
        )
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.state.drain()
        finally:
            self.should_exit = True


async def _load_in_daemon_thread(make: Callable[[], AsyncLLM]) -> AsyncLLM:
    """Like asyncio.to_thread, but a signal during a long load need not wait for it to finish."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[AsyncLLM] = loop.create_future()

    def settle(result: AsyncLLM | None, error: BaseException | None) -> None:
        if future.done():  # cancelled: the server stopped while loading
            return
        if error is not None:
            future.set_exception(error)
        else:
            assert result is not None  # settle(result, None) on success
            future.set_result(result)

    def run() -> None:
        try:
            result = make()
        except BaseException as e:  # noqa: BLE001 - delivered to the awaiting task
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name="ember-load", daemon=True).start()
    return await future


async def _exit_when_engine_dies(server: _Server, engine: AsyncLLM) -> None:
    while engine.dead_reason is None:  # noqa: ASYNC110 - set by the engine's output thread, not this loop
        await asyncio.sleep(0.1)
    logger.error("the engine stopped (%s); exiting in %gs", engine.dead_reason, _DEAD_ENGINE_GRACE_S)
    await asyncio.sleep(_DEAD_ENGINE_GRACE_S)
    server.exit_code = 1
    server.should_exit = True


async def _serve(
    ns: argparse.Namespace, sock: socket.socket, args: EngineArgs, settings: ServerSettings, client: EngineCoreClient
) -> int:
    host, port = sock.getsockname()[:2]
    app = build_app(settings)
    state: ServerState = app.state.ember
    route_server_logs(hide_text=not settings.log_request_text)
    # By default uvicorn's own INFO lines would repeat what our one start-up line says; warnings still show.
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=ns.uvicorn_log_level,
        access_log=False,
        timeout_graceful_shutdown=_CONNECTION_CLOSE_GRACE_S,
    )
    server = _Server(config, state)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    loading = asyncio.ensure_future(
        _load_in_daemon_thread(
            lambda: AsyncLLM(
                args, max_waiting_requests=ns.max_waiting_requests, served_model_name=settings.model_name, client=client
            )
        )
    )
    await asyncio.wait({serving, loading}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():  # stopped by a signal while loading
        loading.cancel()
        await serving
        return 0
    if (error := loading.exception()) is not None:
        server.should_exit = True
        await serving
        raise error
    engine = loading.result()
    state.engine = engine
    if state.draining:  # a signal arrived just as loading finished
        await state.close()
    else:
        display = f"[{host}]" if ":" in host else host
        heap.settle()  # start-up is over (see ember.server.launch)
        timeline.mark("accepting requests")
        logger.info("serving %s at http://%s:%d (%s)", settings.model_name, display, port, engine.ready.description)
        logger.info(
            "start-up, seconds since the process started: %s",
            timeline.summary(timeline.take() + engine.ready.timeline, timeline.process_start()),
        )
        server.watchdog = asyncio.create_task(_exit_when_engine_dies(server, engine))
    await serving
    if not state.draining:
        await state.close()
    return server.exit_code
