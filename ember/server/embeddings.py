"""POST /v1/embeddings: OpenAI's embeddings API over the engine's pooling requests (docs/pooling.md).

Each input (a text, or a list of token ids) becomes one pooling request; they run in the same
scheduler as generation and come back in input order. `encoding_format` "base64" sends each vector
as its little-endian float32 bytes, as OpenAI does (the `openai` client's default: it decodes them).
"""

from __future__ import annotations

import base64
import struct
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from ember.frontend.async_llm import AsyncLLM
from ember.frontend.output import RequestOutput
from ember.pooling.params import PoolingParams
from ember.sampling.params import SamplingParams
from ember.server.errors import bad_request
from ember.server.generation import Generation, respond
from ember.server.openapi import GENERATION_ERRORS, route_docs
from ember.server.plumbing import check_api_key, read_body, ready_engine
from ember.server.state import get_state

router = APIRouter(dependencies=[Depends(check_api_key)])


class EmbeddingRequest(BaseModel):
    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # accepted and ignored, as OpenAI's abuse-monitoring id means nothing here
    truncate_prompt_tokens: int | None = None  # vLLM's extra: keep the input's last N tokens (-1: the window)
    normalize: bool | None = None  # vLLM's extra: None takes the engine's pooler config

    # what the engine's messages call this API's fields
    param_aliases: ClassVar[dict[str, str]] = {"prompt": "input", "prompt_token_ids": "input"}


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


@router.post(
    "/v1/embeddings", **route_docs(body=EmbeddingRequest, response=EmbeddingResponse, errors=GENERATION_ERRORS)
)
async def create_embedding(request: Request, engine: AsyncLLM = Depends(ready_engine)) -> Response:
    body = await read_body(request, EmbeddingRequest)
    state = get_state(request)
    try:
        pooling = PoolingParams(body.dimensions, body.normalize, body.truncate_prompt_tokens)
    except ValueError as e:
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from None
    rid = f"embd-{uuid.uuid4().hex}"
    gen = Generation(
        state,
        engine,
        rid,
        _inputs(body),
        SamplingParams(max_tokens=1),
        EmbeddingRequest,
        state.lora_for(body.model),
        pooling,
    )
    model = state.served_model(body.model)
    return await respond(request, gen, False, _no_stream, lambda finals: _response(body, model, finals))


def _inputs(body: EmbeddingRequest) -> list[Any]:
    """The request's inputs: one text or token-id list, or a list of them."""
    value = body.input
    inputs: list[Any] = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else list(value)
    if not inputs:
        raise bad_request("input must not be empty", "input")
    for i, item in enumerate(inputs):
        if not item:
            raise bad_request(f"input[{i}] must not be empty", "input")
    return inputs


async def _no_stream() -> AsyncIterator[BaseModel]:  # embeddings never stream
    raise AssertionError("embeddings are not streamed")
    yield  # pragma: no cover


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _response(body: EmbeddingRequest, model: str, finals: list[RequestOutput]) -> EmbeddingResponse:
    data = []
    for i, out in enumerate(finals):
        assert out.embedding is not None  # a finished pooling request carries its vector
        data.append(EmbeddingData(index=i, embedding=_encode(out.embedding, body.encoding_format)))
    tokens = sum(len(o.prompt_token_ids) for o in finals)
    return EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
