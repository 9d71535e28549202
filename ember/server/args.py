"""`ember serve`'s flags, its YAML config file and the server settings they make.

Kept apart from the server itself so that building the command line (`ember --help`) imports
neither torch nor the web stack; the server module is imported when `ember serve` runs.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

from ember.config import DEFAULT_MODEL, EngineArgs
from ember.server.reasoning import REASONING_PARSERS
from ember.server.responses_store import MEMORY, StoreLimits
from ember.server.tool_parsers import TOOL_PARSERS

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the id clients send as `model` and see in /v1/models
    model_root: str  # where the weights came from, shown as the model's `root`
    # Any one of them lets a request in; stored responses are kept apart per key (responses_store.py).
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    log_requests: bool = False
    log_request_text: bool = False  # prompts, outputs and error messages in the logs
    shutdown_timeout: float = 30.0
    tool_call_parser: str | None = None  # None: picked from the chat template, when it teaches one
    reasoning_parser: str | None = None
    fastapi_docs: bool = True  # /openapi.json, /docs and /redoc
    responses_store_path: str = MEMORY  # the Responses API's stored responses; in memory unless a file is named
    responses_store_limits: StoreLimits = StoreLimits()
    lora_modules: tuple[tuple[str, str], ...] = ()  # --lora-modules: (name, adapter directory), served as models
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter: --allow-runtime-lora-updating, or vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=true
    allow_runtime_lora_updating: bool = False


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_args(serve)
    return serve


class _Default:
    """Wraps a flag's default so `resolve_args` can tell it from a typed value that a YAML entry must not override."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:  # what `%(default)s` shows in --help
        return str(self.value)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=None, help=f"HF model directory, .gguf file, or '{DEFAULT_MODEL}' (default)"
    )
    g = parser.add_argument_group("server")
    g.add_argument("--config", default=None, help="YAML file of flags (dashes or underscores); the command line wins")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="the model id clients use (default: the model path)")
    g.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help="require one of these keys, as 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
        "(default: $EMBER_API_KEY, several separated by commas)",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 429 once this many requests wait for the engine (default: no limit)",
    )
    g.add_argument("--max-request-body-bytes", type=int, default=1 << 20, help="larger bodies get 413")
    g.add_argument(
        "--log-requests",
        action="store_true",
        help="log one line per request: ids, timings, token counts, sampling parameters (no text)",
    )
    g.add_argument(
        "--log-request-text",
        action="store_true",
        help="let prompts, outputs and error messages reach the logs (off: they never do)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=UVICORN_LOG_LEVELS,
        help="uvicorn's own log level (Ember's: $EMBER_LOGGING_LEVEL)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM/SIGINT",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="how tool calls appear in the model's answers (default: from the chat template)",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="move the answer's <think>...</think> part into reasoning_content",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help='LoRA adapters served as models named NAME (needs --enable-lora; JSON {"name", "path"} also taken)',
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
    )
    g.add_argument(
        "--disable-fastapi-docs", action="store_true", help="serve no /openapi.json, /docs (Swagger UI) or /redoc"
    )
    limits = StoreLimits()
    g.add_argument(
        "--responses-store-path",
        default=MEMORY,
        help="SQLite file for the Responses API's stored responses, kept across restarts (default: in memory)",
    )
    g.add_argument(
        "--responses-store-max-entries",
        type=int,
        default=limits.max_entries,
        help="stored responses kept, the oldest dropped first (default: %(default)s)",
    )
    g.add_argument(
        "--responses-store-max-bytes",
        type=int,
        default=limits.max_bytes,
        help="bytes of stored responses kept, the oldest dropped first (default: %(default)s)",
    )
    g.add_argument(
        "--responses-store-ttl",
        type=float,
        default=limits.ttl_s,
        help="seconds a stored response is kept (default: %(default)s, 30 days)",
    )
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
    import yaml  # with --config only: 9 ms of the front end's start (median of 3, 2-core EPYC, 2026-12-07)

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_args(parser)
    argv, dests = mapping_to_argv(parser, config, f"--config {path}")
    try:
        parsed = vars(parser.parse_args(argv))
    except argparse.ArgumentError as e:
        raise ValueError(f"--config {path}: {e}") from None
    return {d: v.value if isinstance(v, _Default) else v for d, v in parsed.items() if d in dests}


def mapping_to_argv(
    parser: argparse.ArgumentParser, config: dict[str, Any], source: str
) -> tuple[list[str], list[str]]:
    """`{flag_name: value}` (dashes or underscores) as the command line that gives those values (and
    the destinations it sets), so a mapping (a YAML file, a Ray Serve application's args) gets the
    parser's checks like typed flags."""
    flags = {opt: action for action in parser._actions for opt in action.option_strings}
    argv: list[str] = []
    dests: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        action = flags.get(flag)
        if action is None or flag == "--config":
            raise ValueError(f"{source}: unknown option {key!r}")
        dests.append(action.dest)
        if action.nargs == 0:  # on/off flags
            if not isinstance(value, bool):
                raise ValueError(f"{source}: {key} must be true or false, got {value!r}")
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if value else "--no-" + flag[2:])
            elif value:
                argv.append(flag)
        elif isinstance(value, list) and action.nargs in ("+", "*"):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):  # a JSON-valued flag (--speculative-config)
            argv += [flag, json.dumps(value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv, dests


def _store_limits(ns: argparse.Namespace) -> StoreLimits:
    for name in ("responses_store_max_entries", "responses_store_max_bytes", "responses_store_ttl"):
        if getattr(ns, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(ns, name)}")
    return StoreLimits(ns.responses_store_max_entries, ns.responses_store_max_bytes, ns.responses_store_ttl)


def _api_keys(flag: list[str] | None) -> tuple[str, ...]:
    keys = flag if flag is not None else os.environ.get("EMBER_API_KEY", "").split(",")
    return tuple(k.strip() for k in keys if k.strip())


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
    settings = ServerSettings(
        model_name=ns.served_model_name or root,
        model_root=root,
        api_keys=_api_keys(ns.api_key),
        max_body_bytes=ns.max_request_body_bytes,
        log_requests=ns.log_requests,
        log_request_text=ns.log_request_text,
        shutdown_timeout=ns.shutdown_timeout,
        tool_call_parser=ns.tool_call_parser,
        reasoning_parser=ns.reasoning_parser,
        fastapi_docs=not ns.disable_fastapi_docs,
        responses_store_path=ns.responses_store_path,
        responses_store_limits=_store_limits(ns),
        lora_modules=_lora_modules(ns.lora_modules),
        allow_runtime_lora_updating=ns.allow_runtime_lora_updating
        or os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
    )
    if (settings.lora_modules or settings.allow_runtime_lora_updating) and not args.enable_lora:
        raise ValueError("--lora-modules and runtime LoRA updating need --enable-lora")
    return args, settings


def _lora_modules(flag: list[str] | None) -> tuple[tuple[str, str], ...]:
    """`name=path` items (vLLM's form), or their JSON {"name": ..., "path": ...}; names must differ."""
    modules: dict[str, str] = {}
    for item in flag or ():
        if item.lstrip().startswith("{"):
            spec = json.loads(item)
            name, path = spec.get("name"), spec.get("path")
        else:
            name, _, path = item.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules: expected NAME=PATH or JSON with name and path, got {item!r}")
        if name in modules:
            raise ValueError(f"--lora-modules: {name!r} is given twice")
        modules[name] = path
    return tuple(modules.items())
