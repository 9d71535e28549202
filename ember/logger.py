"""Ember's log output: INFO lines on stderr by default, level from EMBER_LOGGING_LEVEL.

`ember serve` sends every other logger's records (uvicorn's, asyncio's) through the same handler,
and unless `--log-request-text` is given, the handler shows exceptions without their messages: a
message can quote the request that caused it (a prompt, a chat message), and logs are often kept
longer and read by more people than the requests themselves.
"""

import logging
import os
import traceback


def init_logging() -> None:
    logger = logging.getLogger("ember")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("EMBER_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False


_HIDDEN = "<message hidden; --log-request-text shows it>"


class HideExceptionText(logging.Filter):
    """Formats a record's exception as its type and stack only (chained and grouped exceptions too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:  # even if another handler formatted it
            record.exc_text = _without_messages(record.exc_info[1]).rstrip("\n")
        return True


def _without_messages(exc: BaseException, seen: set[int] | None = None) -> str:
    seen = seen if seen is not None else set()
    seen.add(id(exc))
    out = ""
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is not None and id(cause) not in seen:
        link = (
            "The above exception was the direct cause of the following exception"
            if exc.__cause__ is not None
            else "During handling of the above exception, another exception occurred"
        )
        out = _without_messages(cause, seen) + f"\n{link}:\n\n"
    out += "Traceback (most recent call last):\n" + "".join(traceback.format_tb(exc.__traceback__))
    out += f"{type(exc).__module__}.{type(exc).__qualname__}: {_HIDDEN}\n"
    subs = getattr(exc, "exceptions", ())  # an exception group's members (anyio raises groups)
    for i, sub in enumerate(subs if isinstance(subs, tuple) else ()):
        out += f"  sub-exception {i + 1}:\n" + _without_messages(sub, seen)
    return out


def route_server_logs(hide_text: bool) -> None:
    """In `ember serve`: every logger through Ember's handler, exception messages hidden if `hide_text`."""
    init_logging()
    handler = logging.getLogger("ember").handlers[0]
    if hide_text:
        handler.addFilter(HideExceptionText())
    root = logging.getLogger()
    if handler not in root.handlers:
        root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)
