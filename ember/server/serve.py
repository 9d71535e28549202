"""`ember serve`: the OpenAI-compatible server from the command line.

The port is bound first and the model loaded after, so `/health` answers 503 while loading and
orchestrators can tell "starting" from "dead". On SIGTERM/SIGINT the server keeps its socket
open but answers 503 to new work while running requests finish (up to `--shutdown-timeout`),
then exits 0; a second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
import yaml

from ember.config import DEFAULT_MODEL, EngineArgs
from ember.engine.async_llm import AsyncLLM
from ember.server.app import ServerSettings, ServerState, build_app

logger = logging.getLogger("ember")

# Enough for finished streams to write their last bytes; the real wait is `--shutdown-timeout`.
_CONNECTION_CLOSE_GRACE_S = 5.0


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    return serve


class _Default:
    """Wraps a flag's default so `cmd_serve` can tell it from a typed value that a YAML entry must not override."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:  # what `%(default)s` shows in --help
        return str(self.value)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help=f"HF model directory, .gguf file, or '{DEFAULT_MODEL}' (default)")
    g = parser.add_argument_group("server")
    g.add_argument("--config", default=None, help="YAML file of flags (dashes or underscores); the command line wins")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="the model id clients use (default: the model path)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $EMBER_API_KEY)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 429 once this many requests wait for the engine (default: no limit)")
    g.add_argument("--max-request-body-bytes", type=int, default=1 << 20, help="larger bodies get 413")
    g.add_argument("--log-requests", action="store_true", help="log one line per request (no prompt text)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM/SIGINT")
    EngineArgs.add_cli_args(parser)
    for action in parser._actions:
        if action.default is not argparse.SUPPRESS:
            action.default = _Default(action.default)


def resolve_args(ns: argparse.Namespace) -> argparse.Namespace:
    """Unwrap the defaults, with a `--config` YAML file between them and the command line."""
    typed = {k: v for k, v in vars(ns).items() if not isinstance(v, _Default)}
    values = {k: v.value if isinstance(v, _Default) else v for k, v in vars(ns).items()}
    if values["config"] is not None:
        values.update({k: v for k, v in _read_config(values["config"]).items() if k not in typed})
    # A positional MODEL on the command line beats a YAML `model` (which arrives as --model).
    if "model" in typed and "model_flag" not in typed:
        values["model_flag"] = None
    return argparse.Namespace(**values)


def _read_config(path: str) -> dict[str, Any]:
    """The YAML entries as parsed flag values: turned into flags and parsed by the same parser, so they
    get the same type checks and choices as typed ones."""
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_args(parser)
    flags = {opt: action for action in parser._actions for opt in action.option_strings}
    argv: list[str] = []
    dests = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        action = flags.get(flag)
        if action is None or flag == "--config":
            raise ValueError(f"--config {path}: unknown option {key!r}")
        dests.append(action.dest)
        if action.nargs == 0:  # on/off flags
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key} must be true or false, got {value!r}")
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if value else "--no-" + flag[2:])
            elif value:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    try:
        parsed = vars(parser.parse_args(argv))
    except argparse.ArgumentError as e:
        raise ValueError(f"--config {path}: {e}") from None
    return {d: v.value if isinstance(v, _Default) else v for d, v in parsed.items() if d in dests}


def settings_from_args(ns: argparse.Namespace) -> tuple[EngineArgs, ServerSettings]:
    if ns.model is not None and ns.model_flag is not None and ns.model != ns.model_flag:
        raise ValueError(f"model given twice: {ns.model!r} and --model {ns.model_flag!r}")
    if ns.max_waiting_requests is not None and ns.max_waiting_requests < 0:
        raise ValueError(f"max_waiting_requests must be >= 0, got {ns.max_waiting_requests}")
    if ns.max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be positive, got {ns.max_request_body_bytes}")
    if ns.shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be >= 0, got {ns.shutdown_timeout}")
    args = EngineArgs.from_cli_args(ns)
    root = args.model or DEFAULT_MODEL
    settings = ServerSettings(model_name=ns.served_model_name or root, model_root=root,
                              api_key=ns.api_key or os.environ.get("EMBER_API_KEY") or None,
                              max_body_bytes=ns.max_request_body_bytes, log_requests=ns.log_requests,
                              shutdown_timeout=ns.shutdown_timeout)
    return args, settings


def cmd_serve(ns: argparse.Namespace) -> int:
    ns = resolve_args(ns)
    args, settings = settings_from_args(ns)
    return asyncio.run(_serve(ns, args, settings))


class _Server(uvicorn.Server):
    """uvicorn, with Ember's drain on SIGTERM/SIGINT.

    Plain uvicorn closes the listening socket at once (so nobody could see /health turn 503) and
    re-raises the signal after its shutdown, which makes a clean stop exit 143 instead of 0.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_task: asyncio.Task[None] | None = None

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
        logger.info("%s: refusing new requests; running ones get up to %gs to finish",
                    signal.Signals(sig).name, self.state.settings.shutdown_timeout)
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.state.drain()
        finally:
            self.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    family, type_, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


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
            future.set_result(result)

    def run() -> None:
        try:
            result = make()
        except BaseException as e:  # delivered to the awaiting task
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name="ember-load", daemon=True).start()
    return await future


async def _serve(ns: argparse.Namespace, args: EngineArgs, settings: ServerSettings) -> int:
    try:
        sock = _bind(ns.host, ns.port)
    except OSError as e:
        raise ValueError(f"cannot listen on {ns.host}:{ns.port}: {e.strerror or e}") from None
    host, port = sock.getsockname()[:2]
    app = build_app(settings)
    state: ServerState = app.state.ember
    # uvicorn's own INFO lines would repeat what our one start-up line says; warnings still show.
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=_CONNECTION_CLOSE_GRACE_S)
    server = _Server(config, state)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    loading = asyncio.ensure_future(_load_in_daemon_thread(
        lambda: AsyncLLM(args, max_waiting_requests=ns.max_waiting_requests,
                         served_model_name=settings.model_name)))
    await asyncio.wait({serving, loading}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():  # stopped by a signal while loading
        loading.cancel()
        await serving
        return 0
    if loading.exception() is not None:
        server.should_exit = True
        await serving
        raise loading.exception()
    engine = loading.result()
    state.engine = engine
    if state.draining:  # a signal arrived just as loading finished
        await state.close()
    else:
        display = f"[{host}]" if ":" in host else host
        logger.info("serving %s at http://%s:%d on %s: %d KV blocks of %d tokens, max concurrency %.1fx at %d tokens",
                    settings.model_name, display, port, engine.device, engine.num_blocks, engine.block_size,
                    engine.max_concurrency, engine.max_model_len)
    await serving
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m ember.server.serve ...`, the same as `ember serve ...`."""
    parser = argparse.ArgumentParser(prog="ember serve", description="Ember's OpenAI-compatible server")
    add_serve_args(parser)
    try:
        return cmd_serve(parser.parse_args(argv))
    except ValueError as e:  # bad flags, bad model files, a taken port: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
