"""The HTTP client Ember's tools use to talk to an OpenAI-compatible server.

`ember bench serve` streams completions through it and times their chunks (OpenAI's completions, chat
completions and Responses API, Anthropic's Messages API: `APIS`, one `Api` each); `ember run-batch --url`
POSTs its lines through it. It is a small HTTP/1.1 client over `asyncio.open_connection`, one
connection per request (`Connection: close`), with Content-Length, chunked and read-to-close bodies:
Ember declares no HTTP client library as a dependency, and this keeps both tools usable with nothing
beyond Ember installed. The extra TCP handshake per request costs well under a millisecond on a local
or LAN connection. It imports nothing of Ember.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
RESPONSES, MESSAGES = "/v1/responses", "/v1/messages"  # OpenAI's Responses API, Anthropic's Messages API
_ERROR_BODY_LIMIT = 64 * 1024  # bytes of an error response read for its message
_LINE_LIMIT = 16 * 1024 * 1024  # longest header or SSE line accepted
_GET_TIMEOUT_S = 30.0


class ProtocolError(Exception):
    """The server's bytes do not make a valid HTTP response or event stream."""


class HTTPStatusError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class StreamError(Exception):
    """An error event inside a stream that had already answered 200."""


class Response:
    """Status and headers of one response, and its body, read once as bytes, or as server-sent events."""

    def __init__(
        self, status: int, headers: dict[str, str], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.status = status
        self.headers = headers
        self._reader = reader
        self._writer = writer

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        reader = self._reader
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readline()
                if not size_line.endswith(b"\n"):
                    raise ProtocolError("connection closed inside a chunked body")
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size line {size_line[:40]!r}") from None
                if size == 0:  # last chunk; skip any trailers up to the blank line
                    while (await reader.readline()).strip():
                        pass
                    return
                data = await reader.readexactly(size)
                if (await reader.readexactly(2)) != b"\r\n":
                    raise ProtocolError("chunk not followed by CRLF")
                yield data
        elif "content-length" in self.headers:
            try:
                remaining = int(self.headers["content-length"])
            except ValueError:
                raise ProtocolError(f"bad Content-Length {self.headers['content-length']!r}") from None
            while remaining > 0:
                data = await reader.read(min(remaining, 1 << 16))
                if not data:
                    raise ProtocolError(f"connection closed with {remaining} body bytes missing")
                remaining -= len(data)
                yield data
        else:  # HTTP/1.0 style: the body runs until the server closes the connection
            while data := await reader.read(1 << 16):
                yield data

    async def read(self, limit: int | None = None) -> bytes:
        body = bytearray()
        async for data in self.iter_bytes():
            body += data
            if limit is not None and len(body) >= limit:
                return bytes(body[:limit])
        return bytes(body)

    async def iter_sse(self) -> AsyncGenerator[str, None]:
        """The `data` of each server-sent event (several `data:` lines of one event joined by newlines)."""
        buffer = b""
        data: list[str] = []
        async for chunk in self.iter_bytes():
            *lines, buffer = (buffer + chunk).split(b"\n")
            if len(buffer) > _LINE_LIMIT:
                raise ProtocolError("event stream line too long")
            for raw in lines:
                line = raw.rstrip(b"\r").decode("utf-8")
                if not line:
                    if data:
                        yield "\n".join(data)
                        data = []
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
                # comments (":...") and other fields (event:, id:, retry:) carry nothing we use
        tail = buffer.rstrip(b"\r").decode("utf-8")
        if tail.startswith("data:"):
            data.append(tail[5:].removeprefix(" "))
        if data:
            yield "\n".join(data)

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)


async def http_request(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None) -> Response:
    """Send one request (a JSON body if `body` is not None) on a new connection; returns once the headers are in."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    host = parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    context = ssl.create_default_context() if parts.scheme == "https" else None
    reader, writer = await asyncio.open_connection(host, port, ssl=context, limit=_LINE_LIMIT)
    try:
        host_header = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            host_header += f":{parts.port}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [
            f"{method} {target} HTTP/1.1",
            f"Host: {host_header}",
            "User-Agent: ember-bench",
            "Accept: */*",
            "Connection: close",
        ]
        payload = b""
        if body is not None:
            payload = json.dumps(body).encode("utf-8")
            lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload)
        await writer.drain()
        while True:
            status_line = await reader.readline()
            if not status_line:
                raise ProtocolError("connection closed before a response")
            fields = status_line.decode("latin-1").split(None, 2)
            if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
                raise ProtocolError(f"bad status line {status_line[:80]!r}")
            status = int(fields[1])
            response_headers: dict[str, str] = {}
            while True:
                line = await reader.readline()
                if not line.endswith(b"\n"):
                    raise ProtocolError("connection closed inside the response headers")
                line = line.rstrip(b"\r\n")
                if not line:
                    break
                name, sep, value = line.decode("latin-1").partition(":")
                if not sep:
                    raise ProtocolError(f"bad header line {line[:80]!r}")
                key = name.strip().lower()
                value = value.strip()
                response_headers[key] = f"{response_headers[key]}, {value}" if key in response_headers else value
            if status >= 200 or status == 101:  # 1xx interim responses (100 Continue, ...) precede the real one
                return Response(status, response_headers, reader, writer)
    except BaseException:
        writer.close()
        raise


def error_message(body: bytes) -> str:
    """The message of an error body: OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or the text itself."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:300] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail")
            if msg:
                return str(msg)[:300]
        elif isinstance(err, str):
            return err[:300]
    return text[:300]


async def get_json(url: str, headers: dict[str, str], timeout: float = _GET_TIMEOUT_S) -> Any:
    async def get() -> Any:
        resp = await http_request("GET", url, headers=headers)
        try:
            body = await resp.read(_LINE_LIMIT)
        finally:
            await resp.close()
        if resp.status != 200:
            raise HTTPStatusError(resp.status, error_message(body))
        return json.loads(body)

    return await asyncio.wait_for(get(), timeout)


# ---- one completion stream, timed ---------------------------------------------------------------


@dataclass(kw_only=True)
class StreamTiming:
    """What the client saw of one stream. Keyword-only, so that a result that adds its own fields can extend it."""

    ttft: float | None = None  # seconds from sending to the first chunk that carries output
    e2e: float | None = None  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds between consecutive output chunks
    text_chunks: int = 0
    prompt_tokens: int | None = None  # from the server's usage
    output_tokens: int | None = None  # from the server's usage, else text_chunks
    _last_output: float | None = field(default=None, init=False, repr=False, compare=False)

    def output_chunk(self, now: float, start: float) -> None:
        """A chunk that carries output arrived at `now` for a request sent at `start` (perf_counter both)."""
        if self.ttft is None:
            self.ttft = now - start
        else:
            self.itl.append(now - (start if self._last_output is None else self._last_output))
        self._last_output = now
        self.text_chunks += 1

    def finish(self, now: float, start: float) -> None:
        """A choice finished: if every token decoded to nothing (e.g. skipped special tokens), its TTFT is now."""
        if self.ttft is None:
            self.ttft = now - start


def carries_output(choice: dict[str, Any], chat: bool) -> bool:
    """Text, or a progress chunk: one sent before the finish for tokens whose text is not out yet."""
    if not chat:
        return bool(choice.get("text")) or choice.get("finish_reason") is None
    delta = choice.get("delta") or {}
    # reasoning models stream their thinking in a field of its own; it is output all the same
    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    return bool(text) or (choice.get("finish_reason") is None and not delta.get("role"))


# ---- the APIs: how each asks for a stream and how its events read ------------------------------------

# Times one decoded event that arrived at `now` for a request sent at `start` into the timing; True when
# it says that the answer finished. It may raise StreamError for an error the API reports its own way.
EventReader = Callable[[dict[str, Any], StreamTiming, float, float], bool]


@dataclass(frozen=True)
class Api:
    """One streaming API, as a benchmark client sees it: the request fields that ask for a stream, carry the
    prompt and cap the output, and how its events say output, usage and the end."""

    endpoint: str
    chat: bool  # the prompt is a user message's text (else a completions prompt: text or token ids)
    stream: dict[str, Any]  # the fields that ask for a stream (with usage, where that must be asked for)
    request: Callable[[Any, int], dict[str, Any]]  # (prompt, most output tokens) -> the fields that say them
    read: EventReader
    done: str | None = None  # a `data` line that ends the stream (OpenAI's [DONE]) ...
    last_events: frozenset[str] = frozenset()  # ... or the `type`s of the events that do
    ending: str = "a finish_reason or [DONE]"  # what a stream must end with, for the error when it does not


def _openai_reader(chat: bool) -> EventReader:
    def read(chunk: dict[str, Any], timing: StreamTiming, now: float, start: float) -> bool:
        usage = chunk.get("usage")
        if usage:
            timing.prompt_tokens = usage.get("prompt_tokens", timing.prompt_tokens)
            timing.output_tokens = usage.get("completion_tokens", timing.output_tokens)
        finished = False
        for choice in chunk.get("choices") or ():
            if carries_output(choice, chat):
                timing.output_chunk(now, start)
            if choice.get("finish_reason") is not None:
                finished = True
                timing.finish(now, start)
        return finished

    return read


_RESPONSES_OUTPUT = frozenset(
    ("response.output_text.delta", "response.reasoning_text.delta", "response.function_call_arguments.delta")
)
_RESPONSES_LAST = frozenset(("response.completed", "response.incomplete"))  # Ember and vLLM send completed for both


def _read_responses(event: dict[str, Any], timing: StreamTiming, now: float, start: float) -> bool:
    kind = event.get("type")
    if kind in _RESPONSES_OUTPUT:
        timing.output_chunk(now, start)
        return False
    if kind == "error":
        raise StreamError(f"error event in the stream: {str(event.get('message') or event)[:300]}")
    if kind == "response.failed":
        error = (event.get("response") or {}).get("error") or {}
        raise StreamError(f"response.failed event in the stream: {error.get('message') or error}")
    if kind not in _RESPONSES_LAST:
        return False
    usage = (event.get("response") or {}).get("usage") or {}
    timing.prompt_tokens = usage.get("input_tokens", timing.prompt_tokens)
    timing.output_tokens = usage.get("output_tokens", timing.output_tokens)
    timing.finish(now, start)
    return True


def _read_messages(event: dict[str, Any], timing: StreamTiming, now: float, start: float) -> bool:
    """Errors are {"type": "error", "error": {...}}, which `_parse_chunk` already raises."""
    kind = event.get("type")
    if kind == "content_block_delta":
        timing.output_chunk(now, start)
    elif kind == "message_start":
        usage = (event.get("message") or {}).get("usage") or {}
        if "input_tokens" in usage:  # Anthropic counts the tokens its prompt cache read or wrote apart
            cached = ("cache_read_input_tokens", "cache_creation_input_tokens")
            timing.prompt_tokens = usage["input_tokens"] + sum(usage.get(k) or 0 for k in cached)
    elif kind == "message_delta":  # the stop reason, and the output tokens so far: all of them
        timing.output_tokens = (event.get("usage") or {}).get("output_tokens", timing.output_tokens)
        timing.finish(now, start)
        return True
    return False


APIS = {
    api.endpoint: api
    for api in (
        Api(
            endpoint=COMPLETIONS,
            chat=False,
            stream={"stream": True, "stream_options": {"include_usage": True}},
            request=lambda prompt, n: {"prompt": prompt, "max_tokens": n},
            read=_openai_reader(chat=False),
            done="[DONE]",
        ),
        Api(
            endpoint=CHAT,
            chat=True,
            stream={"stream": True, "stream_options": {"include_usage": True}},
            # Both names: newer servers read max_completion_tokens, older ones (and llama.cpp) max_tokens.
            request=lambda prompt, n: {
                "messages": [{"role": "user", "content": prompt}],
                "max_completion_tokens": n,
                "max_tokens": n,
            },
            read=_openai_reader(chat=True),
            done="[DONE]",
        ),
        Api(
            endpoint=RESPONSES,
            chat=True,
            stream={"stream": True},  # usage comes in response.completed
            request=lambda prompt, n: {"input": prompt, "max_output_tokens": n},
            read=_read_responses,
            last_events=_RESPONSES_LAST,
            ending="response.completed",
        ),
        Api(
            endpoint=MESSAGES,
            chat=True,
            stream={"stream": True},  # usage comes in message_start (input) and message_delta (output)
            request=lambda prompt, n: {"messages": [{"role": "user", "content": prompt}], "max_tokens": n},
            read=_read_messages,
            last_events=frozenset(("message_stop",)),
            ending="message_delta and message_stop",
        ),
    )
}


async def stream_completion(
    url: str, body: dict[str, Any], headers: dict[str, str], api: Api, timing: StreamTiming, start: float
) -> None:
    """POST a streaming request of `api` sent at `start` (perf_counter) and time its events into `timing` as they
    arrive, so that a stream cut short keeps what it saw. Raises HTTPStatusError, StreamError or ProtocolError."""
    resp = await http_request("POST", url, body, headers)
    try:
        if resp.status != 200:
            raise HTTPStatusError(resp.status, error_message(await resp.read(_ERROR_BODY_LIMIT)))
        ended = await _time_events(resp, api, timing, start)
        timing.e2e = time.perf_counter() - start
    finally:
        await resp.close()
    if not ended:
        raise ProtocolError(f"stream ended without {api.ending}")
    if timing.ttft is None:
        raise ProtocolError("stream ended without any output")
    if timing.output_tokens is None:
        timing.output_tokens = timing.text_chunks


async def _time_events(resp: Response, api: Api, timing: StreamTiming, start: float) -> bool:
    """Reads the stream to its end; True when it ended as a stream of `api` should: with its end marker or last
    event, or (OpenAI) with the connection closing after a finish_reason."""
    finished = False
    async with contextlib.aclosing(resp.iter_sse()) as events:
        async for data in events:
            now = time.perf_counter()
            if api.done is not None and data.strip() == api.done:
                return True
            chunk = _parse_chunk(data)
            if api.read(chunk, timing, now, start):
                finished = True
            if api.last_events and chunk.get("type") in api.last_events:
                return finished
    return finished


def _parse_chunk(data: str) -> dict[str, Any]:
    chunk = json.loads(data)
    if not isinstance(chunk, dict):
        raise ProtocolError(f"unexpected event {data[:100]!r}")
    if chunk.get("error"):
        raise StreamError(f"error event in the stream: {error_message(data.encode('utf-8'))}")
    return chunk
