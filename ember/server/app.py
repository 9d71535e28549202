"""The OpenAI-compatible HTTP API over `AsyncLLM`.

`build_app` makes the FastAPI app; `ember serve` (serve.py) runs it under uvicorn and attaches the
engine once it has loaded, so `/health` can answer 503 while the weights are still being read.
Every error leaves in OpenAI's JSON shape, and a client that goes away aborts its engine requests
at once, so a dropped connection never keeps KV blocks busy until `max_tokens`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import prometheus_client
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import ember
from ember.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError, RequestFailedError
from ember.engine.output import RequestOutput
from ember.engine.request import Logprob
from ember.sampling.params import SamplingParams
from ember.server.args import ServerSettings
from ember.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                   ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                   ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionRequest,
                                   CompletionResponse, DeltaMessage, DetokenizeRequest, DetokenizeResponse,
                                   ErrorInfo, ErrorResponse, ModelCard, ModelList, StreamOptions, TextPart,
                                   TokenizeRequest, TokenizeResponse, TopLogprob, UsageInfo)
from ember.tokenizer import Tokenizer

logger = logging.getLogger("ember")

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

# A full queue drains in about a step; a loading or stopping server needs longer.
RETRY_AFTER_QUEUE_FULL_S = 1
RETRY_AFTER_UNAVAILABLE_S = 5
# vLLM's floor for -inf logprobs: JSON has no infinity, and clients expect a number.
MIN_LOGPROB = -9999.0


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", code="service_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)})


@dataclass
class ServerState:
    """What the endpoints share: the settings, the engine once loaded, and whether we are draining."""

    settings: ServerSettings
    engine: AsyncLLM | None = None
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    _closed: bool = field(default=False, init=False)

    async def drain(self) -> None:
        """Refuse new work at once (health and new requests get 503), give running requests up to
        `shutdown_timeout` to finish, then abort the rest."""
        self.draining = True
        await self.close()

    async def close(self) -> None:
        if self.engine is not None and not self._closed:
            self._closed = True
            await self.engine.shutdown(self.settings.shutdown_timeout)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.settings.model_name}'", "not_found_error", "model", "model_not_found")


def build_app(settings: ServerSettings, engine: AsyncLLM | None = None) -> FastAPI:
    """Without an engine the app answers 503 until `app.state.ember.engine` is set."""
    state = ServerState(settings, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await state.close()

    app = FastAPI(title="Ember", version=ember.__version__, lifespan=lifespan, openapi_url=None)
    app.state.ember = state
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)
    app.include_router(_open)
    app.include_router(_api)
    return app


# ---- plumbing -----------------------------------------------------------------------------

def _state(request: Request) -> ServerState:
    return request.app.state.ember


async def _api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


_HTTP_ERROR_TYPES = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed")}


async def _http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    type_, code = _HTTP_ERROR_TYPES.get(exc.status_code, ("invalid_request_error", None))
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return APIError(exc.status_code, message, type_, code=code, headers=exc.headers).response()


async def _unexpected_error_handler(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after this response, so uvicorn logs the traceback; the client gets no trace.
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_server_error").response()


async def _check_api_key(request: Request) -> None:
    key = _state(request).settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Invalid or missing API key; send 'Authorization: Bearer <key>'",
                       "authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def _ready_engine(request: Request) -> AsyncLLM:
    state = _state(request)
    if state.draining:
        raise unavailable("The server is shutting down")
    if state.engine is None:
        raise unavailable("The model is still loading")
    return state.engine


_open = APIRouter()
_api = APIRouter(dependencies=[Depends(_check_api_key)])


async def _parse(request: Request, model: type[M]) -> M:
    """Read and validate a JSON body ourselves, so that size limits, bad UTF-8, bad JSON and wrong
    types all become 400/413 errors in OpenAI's shape, whatever Content-Type the client sent."""
    limit = _state(request).settings.max_body_bytes
    too_large = APIError(413, f"Request body is larger than {limit} bytes", "invalid_request_error",
                         code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    try:
        text = body.decode("utf-8")
        data = json.loads(text)
        if _SURROGATE_ESCAPE.search(text):  # a lone "\ud800" is valid JSON but no text a tokenizer takes
            json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeError as e:
        raise bad_request(f"Request body is not valid UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise bad_request(f"Request body is not valid JSON: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if not err["loc"]:
            raise bad_request(f"Request body must be a JSON object: {err['msg']}") from None
        param = _loc_to_param(err["loc"])
        raise bad_request(f"{param}: {err['msg']}", param) from None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")

# Field names that may follow a list index in an error location; anything else there is a
# pydantic union-member tag such as 'list[int]', which means nothing to the client.
_NESTED_FIELDS = set(ChatMessage.model_fields) | set(TextPart.model_fields) | set(StreamOptions.model_fields)


def _loc_to_param(loc: tuple[int | str, ...]) -> str:
    param = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _NESTED_FIELDS:
            param += f".{part}"
        else:
            break
    return param


_LEADING_NAME = re.compile(r"[A-Za-z_]\w*(?:\[\d+\]|\.\w+)*")
_PARAM_ALIASES = {"prompt_token_ids": "prompt"}


def _value_error(e: ValueError, model: type[BaseModel]) -> APIError:
    """SamplingParams and the engine start their messages with the field at fault; name it as `param`."""
    message = str(e)
    match = _LEADING_NAME.match(message)
    param = None
    if match:
        name = match.group(0)
        root = re.match(r"\w+", name).group(0)
        param = _PARAM_ALIASES.get(root, name if root in model.model_fields else None)
    code = "context_length_exceeded" if "maximum context length" in message else None
    return bad_request(message, param, code)


def _engine_error(e: Exception, state: ServerState, model: type[BaseModel]) -> APIError:
    if isinstance(e, QueueFullError):
        return APIError(429, f"The server is busy: {e}", "rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_QUEUE_FULL_S)})
    if isinstance(e, ValueError):
        return _value_error(e, model)
    if state.draining and not isinstance(e, (RequestFailedError, EngineDeadError)):
        return unavailable(f"The server is shutting down: {e}")
    return APIError(500, f"The request failed inside the engine: {e}", "internal_server_error")


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


class _Generation:
    """One API request's engine requests (one per prompt) merged into one stream of (prompt index, output).

    `start()` waits for every prompt's first output, because the engine reports a rejected request
    (bad length, full queue) only then, and that must become an HTTP error before any streamed byte.
    """

    def __init__(self, state: ServerState, engine: AsyncLLM, request_id: str, prompts: list[Any],
                 params: SamplingParams, request_model: type[BaseModel]) -> None:
        self.state = state
        self.request_id = request_id
        self.params = params
        self.request_model = request_model
        self.final: list[RequestOutput | None] = [None] * len(prompts)
        self._gens = [engine.generate(p, params, request_id if len(prompts) == 1 else f"{request_id}-{i}")
                      for i, p in enumerate(prompts)]
        self._merged = self._merge()
        self._buffered: list[tuple[int, RequestOutput]] = []
        self._started = time.monotonic()
        self._outcome = "cancelled (client disconnected)"
        self._closed = False

    async def _merge(self) -> AsyncIterator[tuple[int, RequestOutput]]:
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
            except Exception as e:
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
        except Exception as e:
            error = _engine_error(e, self.state, self.request_model)
        else:
            if not (out.finished and any(o.finish_reason == "abort" for o in out.outputs)):
                self.final[i] = out
                return i, out
            error = (unavailable("The server shut down before this request finished") if self.state.draining else
                     APIError(500, out.error or "The engine aborted the request", "internal_server_error"))
        self._outcome = f"failed ({error.status}: {error})"
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
            done = [o for o in self.final if o is not None]
            logger.info("request %s %s after %.2fs: %d prompt + %d completion tokens; %s", self.request_id,
                        self._outcome, time.monotonic() - self._started, sum(len(o.prompt_token_ids) for o in done),
                        sum(len(c.token_ids) for o in done for c in o.outputs), _describe(self.params))


_DEFAULT_PARAMS = SamplingParams()


def _describe(params: SamplingParams) -> str:
    """The sampling fields that differ from the defaults; stop strings are counted, not shown, since
    they are user text."""
    parts = []
    for f in fields(SamplingParams):
        value = getattr(params, f.name)
        if value != getattr(_DEFAULT_PARAMS, f.name):
            parts.append(f"{f.name}=<{len(value)} strings>" if f.name == "stop" else f"{f.name}={value!r}")
    return ", ".join(parts) or "default sampling"


async def _respond(request: Request, gen: _Generation, stream: bool,
                   make_chunks: Callable[[], AsyncIterator[BaseModel]],
                   make_response: Callable[[list[RequestOutput]], BaseModel]) -> Response:
    """The shared tail of completions and chat: errors before the first output are plain HTTP
    errors, streams become SSE, and everything is cancelled when the client leaves."""
    try:
        await _until_disconnect(request, gen.start())
        if stream:
            return _EventStream(gen, make_chunks())
        finals = await _until_disconnect(request, gen.run())
    except ClientDisconnected:
        await gen.close()
        return Response(status_code=499)  # nobody reads it; "client closed request", as nginx logs it
    except BaseException:
        await gen.close()
        raise
    await gen.close()
    return Response(make_response(finals).model_dump_json(), media_type="application/json")


class _EventStream(StreamingResponse):
    """Server-sent events that close their generation however the response ends, including when the
    client leaves before the body iterator ever starts (and so before any cleanup inside it could run)."""

    def __init__(self, gen: _Generation, chunks: AsyncIterator[BaseModel]) -> None:
        super().__init__(self._events(chunks), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.gen = gen

    @staticmethod
    async def _events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {chunk.model_dump_json()}\n\n"
        except APIError as e:  # the status is already 200, so the error travels in the stream, as in vLLM
            yield f"data: {ErrorResponse(error=e.info).model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.gen.close()


def _usage(finals: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _sampling_params(body: CompletionRequest | ChatCompletionRequest, engine: AsyncLLM) -> SamplingParams:
    try:
        return body.to_sampling_params(engine.default_sampling_params())
    except ValueError as e:
        err = _value_error(e, type(body))
        if err.info.param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
            err.info.param = "max_completion_tokens"
        raise err from None


def _require_tokenizer(engine: AsyncLLM) -> Tokenizer:
    if engine.tokenizer is None:
        raise bad_request("This model was loaded without a tokenizer; send token ids instead")
    return engine.tokenizer


def _token_text(token_id: int, lp: Logprob, tokenizer: Tokenizer | None) -> str:
    if lp.decoded_token is not None:
        return lp.decoded_token
    piece = tokenizer.id_to_token(token_id) if tokenizer is not None else None
    return piece if piece is not None else f"token_id:{token_id}"


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


# ---- open endpoints -----------------------------------------------------------------------

@_open.get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    if state.draining:
        return unavailable("The server is shutting down").response()
    if state.engine is None:
        return unavailable("The model is still loading").response()
    if not state.engine.is_ready:
        return unavailable("The engine is not running").response()
    return Response(status_code=200)


@_open.get("/version")
async def version() -> dict[str, str]:
    return {"version": ember.__version__}


@_open.get("/metrics")
async def metrics(request: Request) -> Response:
    engine = _state(request).engine
    body = prometheus_client.generate_latest(engine.metrics_registry) if engine is not None else b""
    return Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)


# ---- API endpoints ------------------------------------------------------------------------

@_api.get("/v1/models")
async def list_models(request: Request, engine: AsyncLLM = Depends(_ready_engine)) -> ModelList:
    state = _state(request)
    s = state.settings
    return ModelList(data=[ModelCard(id=s.model_name, created=state.created, root=s.model_root,
                                     max_model_len=engine.max_model_len)])


@_api.post("/v1/completions")
async def create_completion(request: Request, engine: AsyncLLM = Depends(_ready_engine)) -> Response:
    state = _state(request)
    body = await _parse(request, CompletionRequest)
    state.check_model(body.model)
    params = _sampling_params(body, engine)
    prompt = body.prompt
    prompts: list[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    if not prompts:
        raise bad_request("prompt must not be empty", "prompt")
    tokenizer = engine.tokenizer
    rid = f"cmpl-{uuid.uuid4().hex}"
    gen = _Generation(state, engine, rid, prompts, params, CompletionRequest)

    def prompt_text(out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return _require_tokenizer(engine).decode(out.prompt_token_ids, skip_special_tokens=params.skip_special_tokens)

    def logprobs(token_ids: list[int], lps: list[dict[int, Logprob]] | None, offset: int,
                 result: CompletionLogprobs | None = None) -> tuple[CompletionLogprobs | None, int]:
        if lps is None:
            return result, offset
        result = result or CompletionLogprobs()
        for tid, entries in zip(token_ids, lps):
            if entries is None:  # the first prompt token has no logprob
                text = _token_text(tid, Logprob(0.0, 0), tokenizer)
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                text = _token_text(tid, entries[tid], tokenizer)
                result.token_logprobs.append(_lp(entries[tid].logprob))
                top: dict[str, float] = {}
                for t, lp in entries.items():  # sampled token first, then by rank: a text seen twice keeps the first
                    top.setdefault(_token_text(t, lp, tokenizer), _lp(lp.logprob))
                result.top_logprobs.append(top)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
        return result, offset

    def echoed_logprobs(out: RequestOutput) -> tuple[CompletionLogprobs | None, int]:
        """With echo and logprobs, the prompt's tokens lead the logprobs (offsets from 0)."""
        if not body.echo:
            return None, 0
        return logprobs(out.prompt_token_ids, out.prompt_logprobs, 0)

    async def chunks() -> AsyncIterator[CompletionResponse]:
        sent_tokens: dict[int, int] = {}
        offsets: dict[int, int] = {}
        done: set[int] = set()
        async for i, out in gen.outputs():
            for o in out.outputs:
                idx = i * params.n + o.index
                if idx in done:
                    continue
                text = o.delta_text
                prompt_lps = None
                if idx not in sent_tokens:
                    prefix = prompt_text(out) if body.echo else ""
                    text = prefix + text
                    prompt_lps, _ = echoed_logprobs(out)
                    offsets[idx] = len(prefix)
                if not text and o.finish_reason is None and len(o.token_ids) == sent_tokens.get(idx, 0):
                    continue  # nothing new: a chunked prefill step
                # Tokens whose text is held back (an unfinished character, a possible stop string, no
                # tokenizer) still get a chunk, as in vLLM, so clients see progress token by token.
                start = sent_tokens.get(idx, 0)
                lps, offsets[idx] = logprobs(o.token_ids[start:], o.logprobs[start:] if o.logprobs else None,
                                             offsets[idx], prompt_lps)
                sent_tokens[idx] = len(o.token_ids)
                if o.finish_reason is not None:
                    done.add(idx)
                yield CompletionResponse(id=rid, model=state.settings.model_name, choices=[CompletionChoice(
                    index=idx, text=text, logprobs=lps, finish_reason=o.finish_reason, stop_reason=o.stop_reason)])
        if body.include_usage:
            yield CompletionResponse(id=rid, model=state.settings.model_name, choices=[], usage=_usage(gen.final))

    def response(finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, out in enumerate(finals):
            prefix = prompt_text(out) if body.echo else ""
            for o in out.outputs:
                lps, _ = logprobs(o.token_ids, o.logprobs, len(prefix), echoed_logprobs(out)[0])
                choices.append(CompletionChoice(index=i * params.n + o.index, text=prefix + o.text, logprobs=lps,
                                                finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        return CompletionResponse(id=rid, model=state.settings.model_name, choices=choices, usage=_usage(finals))

    return await _respond(request, gen, body.stream, chunks, response)


@_api.post("/v1/chat/completions")
async def create_chat_completion(request: Request, engine: AsyncLLM = Depends(_ready_engine)) -> Response:
    state = _state(request)
    body = await _parse(request, ChatCompletionRequest)
    state.check_model(body.model)
    params = _sampling_params(body, engine)
    tokenizer = _require_tokenizer(engine)
    prompt = await asyncio.to_thread(_render_chat, tokenizer, body.template_messages(), True, False)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    gen = _Generation(state, engine, rid, [prompt], params, ChatCompletionRequest)
    top_n = body.top_logprobs or 0

    def logprobs(token_ids: list[int], lps: list[dict[int, Logprob]] | None) -> ChatLogprobs | None:
        if lps is None:
            return None
        content = []
        for tid, entries in zip(token_ids, lps):
            top = sorted(((t, lp) for t, lp in entries.items() if lp.rank <= top_n), key=lambda e: e[1].rank)
            content.append(ChatTokenLogprob(
                **_top_logprob(tid, entries[tid], tokenizer).model_dump(),
                top_logprobs=[_top_logprob(t, lp, tokenizer) for t, lp in top]))
        return ChatLogprobs(content=content)

    def chunk(choice: ChatChunkChoice | None, usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, model=state.settings.model_name, choices=[choice] if choice else [],
                                   usage=usage)

    async def chunks() -> AsyncIterator[ChatCompletionChunk]:
        for idx in range(params.n):
            yield chunk(ChatChunkChoice(index=idx, delta=DeltaMessage(role="assistant", content="")))
        sent_tokens = [0] * params.n
        done: set[int] = set()
        async for _, out in gen.outputs():
            for o in out.outputs:
                if o.index in done:
                    continue
                if o.delta_text or (o.finish_reason is None and len(o.token_ids) > sent_tokens[o.index]):
                    start = sent_tokens[o.index]
                    lps = logprobs(o.token_ids[start:], o.logprobs[start:] if o.logprobs else None)
                    sent_tokens[o.index] = len(o.token_ids)
                    yield chunk(ChatChunkChoice(index=o.index, delta=DeltaMessage(content=o.delta_text),
                                                logprobs=lps))
                if o.finish_reason is not None:
                    done.add(o.index)
                    start = sent_tokens[o.index]
                    lps = logprobs(o.token_ids[start:], o.logprobs[start:] if o.logprobs else None)
                    yield chunk(ChatChunkChoice(index=o.index, delta=DeltaMessage(), finish_reason=o.finish_reason,
                                                stop_reason=o.stop_reason,
                                                logprobs=lps if lps and lps.content else None))
        if body.include_usage:
            yield chunk(None, _usage(gen.final))

    def response(finals: list[RequestOutput]) -> ChatCompletionResponse:
        out = finals[0]
        choices = [ChatChoice(index=o.index, message=AssistantMessage(content=o.text),
                              logprobs=logprobs(o.token_ids, o.logprobs), finish_reason=o.finish_reason,
                              stop_reason=o.stop_reason) for o in out.outputs]
        return ChatCompletionResponse(id=rid, model=state.settings.model_name, choices=choices, usage=_usage(finals))

    return await _respond(request, gen, body.stream, chunks, response)


def _top_logprob(token_id: int, lp: Logprob, tokenizer: Tokenizer) -> TopLogprob:
    text = _token_text(token_id, lp, tokenizer)
    return TopLogprob(token=text, logprob=_lp(lp.logprob), bytes=list(tokenizer.token_bytes(token_id)))


def _render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                 add_special_tokens: bool) -> dict[str, Any]:
    """Template and tokenize off the event loop: a long conversation takes milliseconds."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as e:  # a bad role or content part, or the template itself refused
        error = _value_error(e, ChatCompletionRequest)
        error.info.param = error.info.param or "messages"
        raise error from None
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=add_special_tokens)}


@_api.post("/tokenize")
async def tokenize(request: Request, engine: AsyncLLM = Depends(_ready_engine)) -> TokenizeResponse:
    state = _state(request)
    body = await _parse(request, TokenizeRequest)
    state.check_model(body.model)
    tokenizer = _require_tokenizer(engine)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Send exactly one of 'prompt' or 'messages'", "prompt")
    if body.messages is not None:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        add_special = bool(body.add_special_tokens)
        ids = (await asyncio.to_thread(_render_chat, tokenizer, messages, body.add_generation_prompt,
                                       add_special))["prompt_token_ids"]
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)


@_api.post("/detokenize")
async def detokenize(request: Request, engine: AsyncLLM = Depends(_ready_engine)) -> DetokenizeResponse:
    state = _state(request)
    body = await _parse(request, DetokenizeRequest)
    state.check_model(body.model)
    tokenizer = _require_tokenizer(engine)
    vocab = engine.model_config.vocab_size
    for i, t in enumerate(body.tokens):
        if not 0 <= t < vocab:
            raise bad_request(f"tokens[{i}]: {t} is not a token id of this model (0 to {vocab - 1})", f"tokens[{i}]")
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))
