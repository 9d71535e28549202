"""The request plumbing that every endpoint module shares, kept here once.

Reading a request: the API key check, the engine dependency, body parsing with its size limit and
OpenAI-shaped 400s, and sampling parameters. Then what completions and chat both need to build their
answers: token text, clamped logprobs and usage counts. Running the request is generation.py's part.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import operator
import re
from itertools import accumulate, count
from typing import Any, Protocol, TypeVar, cast

from fastapi import Request
from pydantic import BaseModel, ValidationError

from ember.frontend.async_llm import AsyncLLM
from ember.frontend.output import CompletionOutput, Logprob, RequestOutput
from ember.sampling.params import SamplingParams
from ember.sampling.structured import StructuredOutputsParams
from ember.server.errors import APIError, bad_request, unavailable, value_error
from ember.server.protocol import (
    ChatMessage,
    StreamOptions,
    TextPart,
    UsageInfo,
)
from ember.server.state import ServerState, get_state
from ember.tokenizer import Tokenizer

M = TypeVar("M", bound=BaseModel)

# vLLM's floor for -inf logprobs: JSON has no infinity, and clients expect a number.
MIN_LOGPROB = -9999.0
# Deepest JSON nesting a body may have. The deepest real bodies are JSON schemas in response_format
# (two levels per nested object); Python's parser recurses per level and fails near 1,000.
MAX_JSON_DEPTH = 100


# ---- access -------------------------------------------------------------------------------


async def check_api_key(request: Request) -> None:
    """Lets a request in with any of the server's keys, sent as a bearer token or as `x-api-key`
    (Anthropic's header), and notes which key it was (`request.state.key_owner`, a digest that the
    response store files its entries under)."""
    keys = get_state(request).settings.api_keys
    request.state.key_owner = ""
    if not keys:
        return
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    sent = [bearer.strip() if scheme.lower() == "bearer" else "", request.headers.get("x-api-key", "").strip()]
    for key in keys:
        if any(hmac.compare_digest(s.encode(), key.encode()) for s in sent if s):
            request.state.key_owner = hashlib.sha256(key.encode()).hexdigest()[:32]
            return
    raise APIError(
        401,
        "Invalid or missing API key; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
        "authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def available_engine(state: ServerState) -> AsyncLLM:
    """The engine, or a 503 while the model loads or the server drains (/health asks the same)."""
    if state.draining:
        raise unavailable("The server is shutting down")
    if state.engine is None:
        raise unavailable("The model is still loading")
    if not state.engine.is_ready:
        raise unavailable("The engine is not running")
    return state.engine


async def ready_engine(request: Request) -> AsyncLLM:
    return available_engine(get_state(request))


# ---- request bodies -----------------------------------------------------------------------


def validate_body(state: ServerState, data: Any, model: type[M]) -> M:
    """A decoded JSON body as `model`, or the 400 (wrong fields or types) or 404 (another model's name)
    that the server answers for it. Shared with `ember run-batch`, which has bodies but no HTTP request."""
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if not err["loc"]:
            raise bad_request(f"Request body must be a JSON object: {err['msg']}") from None
        param = _loc_to_param(err["loc"])
        message = err["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
        raise bad_request(f"{param}: {message}", param) from None
    state.check_model(getattr(body, "model", None))  # bodies without one (load_lora_adapter) name none
    return body


async def _read_body_bytes(request: Request) -> bytearray:
    limit = get_state(request).settings.max_body_bytes
    too_large = APIError(
        413, f"Request body is larger than {limit} bytes", "invalid_request_error", code="request_too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return body


def _too_deep(text: str) -> bool:
    """Whether `text`'s brackets nest deeper than MAX_JSON_DEPTH (outside strings), checked before
    parsing. Costs nothing for a body with fewer brackets than the limit (nearly all of them); else
    one C-speed pass over the brackets (~60 ms for a 1 MiB body of nothing else)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return False
    brackets = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text))
    steps = brackets.translate(_BRACKET_STEPS).encode("latin-1")  # opening 2, closing 0: depth = sum - count
    return max(map(operator.sub, accumulate(steps), count(1)), default=0) > MAX_JSON_DEPTH


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_BRACKET_STEPS = str.maketrans({"[": "\x02", "{": "\x02", "]": "\x00", "}": "\x00"})


def _decode_json(body: bytearray) -> Any:
    try:
        text = body.decode("utf-8")
        if _too_deep(text):
            raise bad_request(f"Request body nests deeper than {MAX_JSON_DEPTH} levels")
        data = json.loads(text)
        if _SURROGATE_ESCAPE.search(text):  # a lone "\ud800" is valid JSON but no text a tokenizer takes
            json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeError as e:
        raise bad_request(f"Request body is not valid UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise bad_request(f"Request body is not valid JSON: {e}") from None
    return data


async def read_body(request: Request, model: type[M]) -> M:
    """Read and validate a JSON body ourselves, so that size limits, bad UTF-8, bad JSON and wrong
    types all become 400/413 errors in OpenAI's shape, whatever Content-Type the client sent."""
    data = _decode_json(await _read_body_bytes(request))
    return validate_body(get_state(request), data, model)


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


class SamplingRequest(Protocol):
    """A request body that carries sampling parameters (every generating API's request model)."""

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams: ...

    def constraint_field(self, params: StructuredOutputsParams) -> str: ...


async def sampling_params(body: SamplingRequest, engine: AsyncLLM) -> SamplingParams:
    """The request's sampling parameters, its constraint checked against the model (see `check_constraint`)."""
    model = cast(type[BaseModel], type(body))  # every SamplingRequest is a request model
    try:
        params = body.to_sampling_params(engine.default_sampling_params())
    except ValueError as e:
        err = value_error(e, model)
        if err.info.param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
            err.info.param = "max_completion_tokens"
        raise err from None
    if params.structured_outputs is not None:
        await check_constraint(
            engine, params.structured_outputs, body.constraint_field(params.structured_outputs), model
        )
    return params


async def check_constraint(
    engine: AsyncLLM, constraint: StructuredOutputsParams, field: str, model: type[BaseModel]
) -> None:
    """A 400 naming `field` when the constraint cannot run on this model: compiled against its
    vocabulary under llguidance's limits in a worker thread (a new grammar takes milliseconds)."""
    try:
        await asyncio.to_thread(engine.check_grammar, constraint, field)
    except ValueError as e:
        raise value_error(e, model) from None


# ---- tokens, logprobs, usage --------------------------------------------------------------


def require_tokenizer(engine: AsyncLLM) -> Tokenizer:
    if engine.tokenizer is None:
        raise bad_request("This model was loaded without a tokenizer; send token ids instead")
    return engine.tokenizer


def token_text(token_id: int, lp: Logprob, tokenizer: Tokenizer | None) -> str:
    if lp.decoded_token is not None:
        return lp.decoded_token
    piece = tokenizer.id_to_token(token_id) if tokenizer is not None else None
    return piece if piece is not None else f"token_id:{token_id}"


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def logprobs_since(o: CompletionOutput, start: int) -> list[dict[int, Logprob]] | None:
    """The logprobs of a choice's tokens from `start` on, if it asked for logprobs."""
    return o.logprobs[start:] if o.logprobs else None


def usage(finals: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
