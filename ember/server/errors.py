"""Every error the server sends, in OpenAI's JSON shape.

`APIError` carries status, OpenAI error fields and headers; the app's exception handlers turn it,
Starlette's HTTP errors and anything unexpected into `{"error": {...}}` bodies. `value_error` and
`engine_error` map what SamplingParams and the engine raise onto the same errors, naming the request
field at fault, so every endpoint reports a failure the same way.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ember.frontend.errors import EngineDeadError, QueueFullError, RequestFailedError
from ember.sampling.structured import GRAMMAR_FAILED
from ember.server.protocol import ErrorInfo, ErrorResponse

if TYPE_CHECKING:
    from ember.server.state import ServerState

logger = logging.getLogger("ember")

# A full queue drains in about a step; a loading or stopping server needs longer.
RETRY_AFTER_QUEUE_FULL_S = 1
RETRY_AFTER_UNAVAILABLE_S = 5


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers
        self.logged = False  # `--log-requests` has already shown this request's end (generation.py)

    def response(self, body: ErrorBody | None = None) -> JSONResponse:
        """The error as JSON, in OpenAI's shape unless the endpoint writes its errors in another (`body`)."""
        content = (body or openai_error_body)(self).model_dump()
        return JSONResponse(content, self.status, headers=self.headers)


ErrorBody = Callable[[APIError], BaseModel]


def openai_error_body(e: APIError) -> BaseModel:
    return ErrorResponse(error=e.info)


def error_body(request: Request) -> ErrorBody:
    """How this request's endpoint writes errors: OpenAI's `{"error": {...}}` unless its router said
    otherwise (the Messages API, through `use_error_body`)."""
    return getattr(request.state, "error_body", openai_error_body)


def use_error_body(body: ErrorBody) -> Callable[[Request], None]:
    """A router dependency (listed before the API key check, so a 401 has the shape too) that makes
    every error of its routes leave in `body`'s shape."""

    def mark(request: Request) -> None:
        request.state.error_body = body

    return mark


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unavailable(message: str) -> APIError:
    return APIError(
        503,
        message,
        "service_unavailable",
        code="service_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)},
    )


# ---- exception handlers -------------------------------------------------------------------


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    settings = request.app.state.ember.settings
    if settings.log_requests and not exc.logged:
        # The message often quotes the request (a bad role, a stop string): only with --log-request-text.
        detail = f": {exc}" if settings.log_request_text else ""
        logger.info(
            "request %s %s rejected (%d %s)%s", request.method, request.url.path, exc.status, exc.info.type, detail
        )
    return exc.response(error_body(request))


_HTTP_ERROR_TYPES = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed")}


async def http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    type_, code = _HTTP_ERROR_TYPES.get(exc.status_code, ("invalid_request_error", None))
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return APIError(exc.status_code, message, type_, code=code, headers=exc.headers).response(error_body(request))


def internal_error(exc: Exception) -> APIError:
    """What a client sees of a bug: the exception's type and message, no trace."""
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_server_error")


async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after this response, so uvicorn logs the traceback.
    return internal_error(exc).response(error_body(request))


# ---- engine exceptions --------------------------------------------------------------------

_LEADING_NAME = re.compile(r"[A-Za-z_]\w*(?:\[\d+\]|\.\w+)*")
_PARAM_ALIASES = {"prompt_token_ids": "prompt"}


def value_error(e: ValueError, model: type[BaseModel]) -> APIError:
    """SamplingParams and the engine start their messages with the field at fault; name it as `param`."""
    message = str(e)
    match = _LEADING_NAME.match(message)
    param = None
    if match:
        name = match.group(0)
        root_match = re.match(r"\w+", name)
        assert root_match is not None  # _LEADING_NAME matched a word character first
        root = root_match.group(0)
        aliases = {**_PARAM_ALIASES, **getattr(model, "param_aliases", {})}  # an API's own names for engine fields
        param = aliases.get(root, name if root in model.model_fields else None)
    code = "context_length_exceeded" if "maximum context length" in message else None
    return bad_request(message, param, code)


def engine_error(e: Exception, state: ServerState, model: type[BaseModel]) -> APIError:
    if isinstance(e, QueueFullError):
        return APIError(
            429,
            f"The server is busy: {e}",
            "rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_QUEUE_FULL_S)},
        )
    if isinstance(e, ValueError):
        return value_error(e, model)
    if isinstance(e, EngineDeadError):
        return unavailable(str(e))
    if isinstance(e, RequestFailedError) and str(e).startswith(GRAMMAR_FAILED):  # the request's own constraint
        return bad_request(str(e), "structured_outputs")
    if state.draining and not isinstance(e, (RequestFailedError, EngineDeadError)):
        return unavailable(f"The server is shutting down: {e}")
    return APIError(500, f"The request failed inside the engine: {e}", "internal_server_error")
