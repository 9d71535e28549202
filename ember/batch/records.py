"""The batch file formats: input lines in, output records out, and what an existing output holds.

Input is OpenAI's Batch API JSONL: `{"custom_id", "method": "POST", "url", "body"}` a line. A line
that cannot run (bad JSON, no `custom_id`, another method or url, a body that is not an object, a
`custom_id` seen before, `stream: true`) becomes a `LineError` carrying its 1-based line number;
whether the body itself is a valid request is for the server's own validation to say.

Output records follow OpenAI's batch output: `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`. `error` is null exactly when the request succeeded, so
`error is None` tells successes from failures; a failure's `error` holds `code`, `message` and the
input `line`, and `response` holds the server's error answer when there was one (null for lines that
never reached it).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("ember")

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)


@dataclass(frozen=True)
class BatchLine:
    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineError:
    line: int
    custom_id: str | None
    code: str
    message: str


def parse_line(line: int, raw: str | dict[str, Any]) -> BatchLine | LineError:
    """One input line (text, or an already decoded dict from `LLM.run_batch`) checked as a batch request."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            return LineError(line, None, "invalid_json", f"line {line}: not valid JSON: {e}")
    if not isinstance(raw, dict):
        return LineError(line, None, "invalid_request", f"line {line}: expected a JSON object")
    custom_id = raw.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(line, None, "missing_custom_id", f"line {line}: custom_id must be a non-empty string")
    method, url, body = raw.get("method", "POST"), raw.get("url"), raw.get("body")
    problem = None
    if method != "POST":
        problem = ("invalid_method", f"method must be 'POST', got {method!r}")
    elif url not in URLS:
        problem = ("invalid_url", f"url must be one of {', '.join(URLS)}; got {url!r}")
    elif not isinstance(body, dict):
        problem = ("invalid_body", "body must be a JSON object")
    elif body.get("stream"):
        problem = ("invalid_body", "body.stream: streaming is not supported in batch jobs")
    if problem is not None:
        return LineError(line, custom_id, problem[0], f"line {line}: {problem[1]}")
    assert isinstance(url, str) and isinstance(body, dict)  # checked above
    return BatchLine(line, custom_id, url, body)


def success_record(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    request_id = body.get("id") or f"req_{uuid.uuid4().hex}"
    return {
        "id": _record_id(),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def error_record(
    custom_id: str | None,
    line: int,
    code: str,
    message: str,
    status: int | None = None,
    body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A failed line; `status` and `body` are the server's error answer, if it gave one."""
    response = None
    if status is not None:
        response = {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body}
    return {
        "id": _record_id(),
        "custom_id": custom_id,
        "response": response,
        "error": {"code": code, "message": message, "line": line},
    }


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


@dataclass
class Done:
    """What an existing output file already answers: these custom_ids, and these input lines (an
    error about a line, such as a duplicate custom_id, is keyed by its line number)."""

    custom_ids: set[str] = field(default_factory=set)
    lines: set[int] = field(default_factory=set)

    def covers(self, item: BatchLine | LineError) -> bool:
        if item.line in self.lines:
            return True
        return isinstance(item, BatchLine) and item.custom_id in self.custom_ids


def read_done(path: str | os.PathLike[str]) -> Done:
    """The records of an earlier run of this job, after cutting off a last line that a killed run
    left unfinished (it had not been flushed whole, so its request runs again)."""
    done = Done()
    if not os.path.exists(path):
        return done
    _cut_unfinished_line(path)
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            try:
                record = json.loads(text)
                custom_id, error = record.get("custom_id"), record.get("error")
            except (ValueError, AttributeError):
                logger.warning("%s line %d is not a batch record; ignored", path, number)
                continue
            if isinstance(custom_id, str):
                done.custom_ids.add(custom_id)
            if isinstance(error, dict) and isinstance(error.get("line"), int):
                done.lines.add(error["line"])
    return done


def _cut_unfinished_line(path: str | os.PathLike[str]) -> None:
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        logger.warning(
            "%s: dropping an unfinished last line (%d bytes) left by an interrupted run", path, len(data) - keep
        )
        f.truncate(keep)
