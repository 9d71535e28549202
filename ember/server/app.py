"""The OpenAI-compatible HTTP API over `AsyncLLM`: the app factory and its wiring.

`build_app` makes the FastAPI app; `ember serve` (serve.py) runs it under uvicorn and attaches the
engine once it has loaded, so `/health` can answer 503 while the weights are still being read.
Every error leaves in OpenAI's JSON shape (errors.py), and a client that goes away aborts its engine
requests at once (generation.py). The endpoints live one group per module, as in vLLM's
`entrypoints/openai/`: health.py (open), models.py, completions.py, chat.py, embeddings.py, score.py
(/v1/score, /rerank), responses.py and anthropic_messages.py (behind the API key); the last three share
one path below HTTP (conversation.py);
lora_adapters.py only with runtime LoRA updating allowed.
Their OpenAPI document (openapi.py) is served at /openapi.json, with /docs and /redoc, unless
`--disable-fastapi-docs`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

import ember
from ember.frontend.async_llm import AsyncLLM
from ember.server import (
    anthropic_messages,
    chat,
    completions,
    embeddings,
    health,
    lora_adapters,
    models,
    openapi,
    responses,
    score,
)
from ember.server.args import ServerSettings
from ember.server.errors import APIError, api_error_handler, http_error_handler, unexpected_error_handler
from ember.server.state import ServerState

__all__ = ["ServerState", "build_app"]


def build_app(settings: ServerSettings, engine: AsyncLLM | None = None) -> FastAPI:
    """Without an engine the app answers 503 until `app.state.ember.engine` is set."""
    state = ServerState(settings, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await state.close()

    docs = settings.fastapi_docs
    app = FastAPI(
        title="Ember",
        version=ember.__version__,
        lifespan=lifespan,
        description="The OpenAI-compatible API of Ember, an LLM inference engine",
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        separate_input_output_schemas=False,
    )
    app.state.ember = state
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)
    for module in (health, models, completions, chat, embeddings, score, responses, anthropic_messages):
        app.include_router(module.router)
    if settings.allow_runtime_lora_updating:
        app.include_router(lora_adapters.router)
    openapi.install(app, api_key=bool(settings.api_keys))
    return app
