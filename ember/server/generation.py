"""Running one API request on the engine and answering it, shared by completions and chat.

`Generation` merges the engine streams of a request's prompts into one and, with `--log-requests`,
logs how the request ended: ids, timings, token counts, finish reasons and sampling parameters, but
no text (prompts, outputs, stop strings, error messages, which can quote the prompt) unless
`--log-request-text` is given too; `respond` turns it into one JSON answer or a stream of server-sent
events (`EventStream`), and cancels the engine requests as soon as the client goes away, so a dropped
connection never keeps KV blocks busy until `max_tokens`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from ember.frontend.async_llm import AsyncLLM
from ember.frontend.output import RequestOutput
from ember.lora.request import LoRARequest
from ember.pooling.params import PoolingParams
from ember.sampling.params import SamplingParams
from ember.server.errors import APIError, ErrorBody, engine_error, openai_error_body, unavailable
from ember.server.state import ServerState

logger = logging.getLogger("ember")

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (which aborts its engine requests) if the client goes away first.

    A non-streaming handler would otherwise notice a vanished client only when it finally writes
    the answer, after generating all of it for nobody.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when we are cancelled ourselves, e.g. by a server shutdown
        watcher.cancel()
        if not task.done():
            task.cancel()
    await asyncio.wait({task})
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


class Generation:
    """One API request's engine requests (one per prompt) merged into one stream of (prompt index, output).

    `start()` waits for every prompt's first output, because the engine reports a rejected request
    (bad length, full queue) only then, and that must become an HTTP error before any streamed byte.
    """

    def __init__(
        self,
        state: ServerState,
        engine: AsyncLLM,
        request_id: str,
        prompts: list[Any],
        params: SamplingParams,
        request_model: type[BaseModel],
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
    ) -> None:
        """`pooling_params`: one for every prompt, or a list with each prompt's (a cross-encoder's pairs)."""
        self.state = state
        self.request_id = request_id
        self.params = params
        self.request_model = request_model
        self.final: list[RequestOutput | None] = [None] * len(prompts)
        self.prompts = prompts
        pooling = pooling_params if isinstance(pooling_params, list) else [pooling_params] * len(prompts)
        self._gens = [
            engine.generate(p, params, request_id if len(prompts) == 1 else f"{request_id}-{i}", lora_request, pool)
            for i, (p, pool) in enumerate(zip(prompts, pooling))
        ]
        self._merged = self._merge()
        self._buffered: list[tuple[int, RequestOutput]] = []
        self._started = time.monotonic()
        self._first_token: float | None = None
        self._outcome = "cancelled (client disconnected)"
        self._error: str | None = None
        self._closed = False

    async def _merge(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        if len(self._gens) == 1:
            async with aclosing(self._gens[0]) as gen:
                async for out in gen:
                    yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in gen:
                    queue.put_nowait((i, out))
                queue.put_nowait((i, None))
            except Exception as e:  # noqa: BLE001 - delivered to the merged stream, which answers it
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self._gens)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    remaining -= 1
                else:
                    yield i, item
        finally:
            # Cancelling a pump cancels its engine.generate(), which aborts that request.
            for t in tasks:
                t.cancel()

    async def _next(self) -> tuple[int, RequestOutput] | None:
        try:
            i, out = await anext(self._merged)
        except StopAsyncIteration:
            return None
        except Exception as e:  # noqa: BLE001 - any engine failure becomes the request's error answer
            error = engine_error(e, self.state, self.request_model)
        else:
            if not (out.finished and any(o.finish_reason == "abort" for o in out.outputs)):
                if self._first_token is None and any(o.token_ids for o in out.outputs):
                    self._first_token = time.monotonic()
                self.final[i] = out
                return i, out
            error = (
                unavailable("The server shut down before this request finished")
                if self.state.draining
                else APIError(500, out.error or "The engine aborted the request", "internal_server_error")
            )
        self._outcome = f"failed ({error.status} {error.info.type})"
        self._error = str(error)
        error.logged = True  # close() logs this request's end
        raise error

    async def start(self) -> None:
        seen: set[int] = set()
        while len(seen) < len(self._gens):
            item = await self._next()
            if item is None:
                break
            self._buffered.append(item)
            seen.add(item[0])

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._buffered:
            yield self._buffered.pop(0)
        while (item := await self._next()) is not None:
            yield item
        self._outcome = "finished"

    async def run(self) -> list[RequestOutput]:
        """All prompts to the end; their final outputs in prompt order."""
        async for _ in self.outputs():
            pass
        return self.final  # type: ignore[return-value]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._merged.aclose()
        if self.state.settings.log_requests:
            logger.info("%s", self._log_line())

    def _log_line(self) -> str:
        done = [o for o in self.final if o is not None]
        now = time.monotonic()
        first = "" if self._first_token is None else f", first token after {self._first_token - self._started:.2f}s"
        reasons = ",".join(str(c.finish_reason) for o in done for c in o.outputs)
        line = (
            f"request {self.request_id} {self._outcome} after {now - self._started:.2f}s{first}: "
            f"{sum(len(o.prompt_token_ids) for o in done)} prompt + "
            f"{sum(len(c.token_ids) for o in done for c in o.outputs)} completion tokens, "
            f"finish reasons [{reasons}]; {describe_params(self.params, self.state.settings.log_request_text)}"
        )
        if self.state.settings.log_request_text:
            text: dict[str, Any] = {
                "prompts": [_prompt_text(p) for p in self.prompts],
                "outputs": [[c.text for c in o.outputs] for o in done],
            }
            if self._error is not None:
                text["error"] = self._error
            line += "; " + json.dumps(text, ensure_ascii=False)
        return line


def _prompt_text(prompt: Any) -> Any:
    """A prompt as the log shows it: its text (a rendered chat too), or its token ids."""
    return prompt.get("prompt", prompt.get("prompt_token_ids")) if isinstance(prompt, dict) else prompt


_DEFAULT_PARAMS = SamplingParams()


def describe_params(params: SamplingParams, with_text: bool) -> str:
    """The sampling fields that differ from the defaults. Fields holding text (stop strings, and any
    future one: grammars, schemas) are shown as their size unless `with_text`, since they are the
    user's text."""
    parts = []
    for f in fields(SamplingParams):
        value = getattr(params, f.name)
        if value != getattr(_DEFAULT_PARAMS, f.name):
            shown = repr(value) if with_text or not _holds_text(value) else f"<{_size(value)}>"
            parts.append(f"{f.name}={shown}")
    return ", ".join(parts) or "default sampling"


def _holds_text(value: object) -> bool:
    if isinstance(value, str):
        return True
    if isinstance(value, dict):
        return any(_holds_text(k) or _holds_text(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_text(v) for v in value)
    return hasattr(value, "__dataclass_fields__") or hasattr(value, "__struct_fields__")


def _size(value: object) -> str:
    if isinstance(value, str):
        return f"{len(value)} characters"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"{len(value)} items"
    return type(value).__name__


@dataclass(frozen=True)
class EventFormat:
    """How an API writes its server-sent events. OpenAI's completions and chat send bare `data:` lines and
    end with `[DONE]`; the Responses and Messages APIs name each event after its `type` field and end with
    an event of their own. `error` writes an error met after the stream answered 200."""

    named: bool = False
    done: str | None = "data: [DONE]\n\n"
    error: ErrorBody = openai_error_body


OPENAI_EVENTS = EventFormat()


async def respond(
    request: Request,
    gen: Generation,
    stream: bool,
    make_chunks: Callable[[], AsyncIterator[BaseModel]],
    make_response: Callable[[list[RequestOutput]], BaseModel],
    events: EventFormat = OPENAI_EVENTS,
) -> Response:
    """The shared tail of every generating endpoint: errors before the first output are plain HTTP
    errors, streams become SSE, and everything is cancelled when the client leaves."""
    try:
        await _until_disconnect(request, gen.start())
        if stream:
            return EventStream(gen, make_chunks(), events)
        finals = await _until_disconnect(request, gen.run())
    except ClientDisconnected:
        await gen.close()
        return Response(status_code=499)  # nobody reads it; "client closed request", as nginx logs it
    except BaseException:
        await gen.close()
        raise
    await gen.close()
    return Response(make_response(finals).model_dump_json(), media_type="application/json")


async def answer(gen: Generation, make_response: Callable[[list[RequestOutput]], M]) -> M:
    """`respond` without a client connection (`ember run-batch`): the whole answer as its model, and
    the same errors as exceptions; cancelling the caller aborts the engine requests."""
    try:
        await gen.start()
        return make_response(await gen.run())
    finally:
        await gen.close()


# Line breaks that JSON leaves raw in strings but that Python's str.splitlines (so httpx's `aiter_lines`)
# and other clients split events on: a token holding one cut an event in two in the CPU soak.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(message: BaseModel, named: bool = False) -> str:
    """One server-sent event: the message as JSON with those line breaks escaped (the same JSON), so the
    event stays one line for every client; `named` puts its `type` in an `event:` line first."""
    data = message.model_dump_json()
    line = f"data: {data if data.isascii() else data.translate(_LINE_BREAKS)}\n\n"
    return f"event: {vars(message)['type']}\n{line}" if named else line  # every named event has a `type` field


class EventStream(StreamingResponse):
    """Server-sent events that close their generation however the response ends, including when the
    client leaves before the body iterator ever starts (and so before any cleanup inside it could run)."""

    def __init__(self, gen: Generation, chunks: AsyncIterator[BaseModel], fmt: EventFormat = OPENAI_EVENTS) -> None:
        super().__init__(
            self._events(chunks, fmt), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.gen = gen

    @staticmethod
    async def _events(chunks: AsyncIterator[BaseModel], fmt: EventFormat) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield sse_event(chunk, fmt.named)
        except APIError as e:  # the status is already 200, so the error travels in the stream, as in vLLM
            yield sse_event(fmt.error(e), fmt.named)
        if fmt.done is not None:
            yield fmt.done

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.gen.close()
