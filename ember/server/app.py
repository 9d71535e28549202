"""The OpenAI-compatible HTTP API over `AsyncLLM`: the app factory and its wiring.

`build_app` makes the FastAPI app; `ember serve` (serve.py) runs it under uvicorn and attaches the
engine once it has loaded, so `/health` can answer 503 while the weights are still being read.
Every error leaves in OpenAI's JSON shape (errors.py), and a client that goes away aborts its engine
requests at once (generation.py). The endpoints live one group per module, as in vLLM's
`entrypoints/openai/`: health.py (open), models.py, completions.py and chat.py (behind the API key).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

import ember
from ember.engine.async_llm import AsyncLLM
from ember.server import chat, completions, health, models
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

    app = FastAPI(title="Ember", version=ember.__version__, lifespan=lifespan, openapi_url=None)
    app.state.ember = state
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)
    for module in (health, models, completions, chat):
        app.include_router(module.router)
    return app
