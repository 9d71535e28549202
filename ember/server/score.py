"""POST /v1/score (vLLM's shape) and POST /v1/rerank, /rerank (Jina's and Cohere's): a reranker's scores
(a cross-encoder, or a decoder reranker of Qwen3-Reranker's style; docs/pooling.md) over the engine's
pooling requests.

Each (query, document) pair becomes one score request (ember.pooling.score's `score_requests`): a
cross-encoder's is the tokenized pair, a decoder's the engine's `ScoreConfig` template.
The pairs run in the same scheduler as generation and come back in input order; /rerank then sorts them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from ember.frontend.async_llm import AsyncLLM
from ember.frontend.output import RequestOutput
from ember.pooling.score import score_pairs, score_requests
from ember.sampling.params import SamplingParams
from ember.server.errors import bad_request
from ember.server.generation import Generation, respond
from ember.server.openapi import GENERATION_ERRORS, route_docs
from ember.server.plumbing import check_api_key, read_body, ready_engine
from ember.server.state import get_state

router = APIRouter(dependencies=[Depends(check_api_key)])


class ScoreRequest(BaseModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None  # the template's {instruction} (None: the engine's score_config default)

    # what the engine's messages call this API's fields: the pair's prompt is text_2's document
    param_aliases: ClassVar[dict[str, str]] = {"input": "text_2", "prompt": "text_2", "prompt_token_ids": "text_2"}


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankRequest(BaseModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True
    instruction: str | None = None

    param_aliases: ClassVar[dict[str, str]] = {
        "input": "documents",
        "prompt": "documents",
        "prompt_token_ids": "documents",
    }


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def _score_generation(
    request: Request, engine: AsyncLLM, rid: str, pairs: list[tuple[str, str]], instruction: str | None, body: Any
) -> Generation:
    """One score request per pair: a cross-encoder's tokenized pair, or the engine's score config's prompt."""
    state = get_state(request)
    if engine.tokenizer is None:
        raise bad_request("scoring needs the model's tokenizer (the server was started without one)")
    try:
        requests = score_requests(
            pairs, engine.tokenizer, engine.score_config, engine.is_encoder, engine.vocab_size, instruction
        )
    except ValueError as e:
        raise bad_request(f"{e} (set the server's --score-config)") from None
    prompts: list[Any] = [prompt for prompt, _ in requests]
    pooling = [params for _, params in requests]
    lora = state.lora_for(body.model)
    return Generation(state, engine, rid, prompts, SamplingParams(max_tokens=1), type(body), lora, pooling)


@router.post("/v1/score", **route_docs(body=ScoreRequest, response=ScoreResponse, errors=GENERATION_ERRORS))
async def create_score(request: Request, engine: AsyncLLM = Depends(ready_engine)) -> Response:
    body = await read_body(request, ScoreRequest)
    try:
        pairs = score_pairs(body.text_1, body.text_2)
    except ValueError as e:
        raise bad_request(str(e), str(e).split(" ", 1)[0].rstrip(":")) from None
    rid = f"score-{uuid.uuid4().hex}"
    gen = _score_generation(request, engine, rid, pairs, body.instruction, body)
    model = get_state(request).served_model(body.model)
    created = int(time.time())

    def response(finals: list[RequestOutput]) -> ScoreResponse:
        data = [ScoreData(index=i, score=_score(out)) for i, out in enumerate(finals)]
        tokens = sum(len(o.prompt_token_ids) for o in finals)
        usage = ScoreUsage(prompt_tokens=tokens, total_tokens=tokens)
        return ScoreResponse(id=rid, created=created, model=model, data=data, usage=usage)

    return await respond(request, gen, False, _no_stream, response)


async def create_rerank(request: Request, engine: AsyncLLM = Depends(ready_engine)) -> Response:
    body = await read_body(request, RerankRequest)
    if not body.documents:
        raise bad_request("documents must not be empty", "documents")
    rid = f"rerank-{uuid.uuid4().hex}"
    gen = _score_generation(request, engine, rid, [(body.query, d) for d in body.documents], body.instruction, body)
    model = get_state(request).served_model(body.model)

    def response(finals: list[RequestOutput]) -> RerankResponse:
        order = sorted(range(len(finals)), key=lambda i: -_score(finals[i]))  # stable: ties keep input order
        if body.top_n:
            order = order[: body.top_n]
        results = [
            RerankResult(
                index=i,
                relevance_score=_score(finals[i]),
                document=RerankDocument(text=body.documents[i]) if body.return_documents else None,
            )
            for i in order
        ]
        tokens = sum(len(o.prompt_token_ids) for o in finals)
        return RerankResponse(id=rid, model=model, usage=RerankUsage(total_tokens=tokens), results=results)

    return await respond(request, gen, False, _no_stream, response)


for _path in ("/v1/rerank", "/rerank"):
    router.post(_path, **route_docs(body=RerankRequest, response=RerankResponse, errors=GENERATION_ERRORS))(
        create_rerank
    )


def _score(out: RequestOutput) -> float:
    assert out.embedding is not None  # a finished score request carries its one value
    return out.embedding[0]


async def _no_stream() -> AsyncIterator[BaseModel]:  # scores are never streamed
    raise AssertionError("scores are not streamed")
    yield  # pragma: no cover
