"""The batch target for an engine in this process: the server's own request code, without HTTP.

Each body goes through the same steps as a POST to `ember serve`: `validate_body` (the pydantic
request models, the model-name check), then `complete` / `complete_chat`, the code the endpoints
run, answering the same response models or the same `APIError`s. So a batch line and an HTTP request
with the same body get the same answer, error or not (tests/test_run_batch.py compares them).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from ember.batch.records import CHAT_URL, COMPLETIONS_URL
from ember.batch.runner import BatchAborted, BatchOptions, BatchRunner, BatchSummary, Reply, Requests
from ember.config import DEFAULT_MODEL, EngineArgs
from ember.frontend.async_llm import AsyncLLM
from ember.frontend.engine import LLMEngine
from ember.server.args import ServerSettings
from ember.server.chat import complete_chat
from ember.server.completions import complete
from ember.server.errors import APIError, internal_error
from ember.server.plumbing import available_engine, validate_body
from ember.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from ember.server.state import ServerState

Handler = Callable[[ServerState, AsyncLLM, Any], Awaitable[BaseModel]]
_ENDPOINTS: dict[str, tuple[type[BaseModel], Handler]] = {
    CHAT_URL: (ChatCompletionRequest, complete_chat),
    COMPLETIONS_URL: (CompletionRequest, complete),
}


class EngineTarget:
    """Answers batch lines as the server's endpoints would, on `state.engine`."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def __call__(self, url: str, data: dict[str, Any]) -> Reply:
        model, handler = _ENDPOINTS[url]
        try:
            engine = available_engine(self.state)
            response = await handler(self.state, engine, validate_body(self.state, data, model))
        except APIError as e:
            dead = self.state.engine.dead_reason if self.state.engine is not None else None
            if dead is not None:
                raise BatchAborted(f"the engine stopped: {dead}") from None
            return _error_reply(e)
        except Exception as e:  # noqa: BLE001 - a bug: answered as the server's 500 would be, and retried
            return _error_reply(internal_error(e))
        return Reply(200, response.model_dump(mode="json"))


def _error_reply(e: APIError) -> Reply:
    retry_after = (e.headers or {}).get("Retry-After")
    return Reply(
        e.status,
        ErrorResponse(error=e.info).model_dump(mode="json"),
        retry_after=float(retry_after) if retry_after else None,
    )


def settings_for(args: EngineArgs) -> ServerSettings:
    """The server settings `ember serve` would make for these engine arguments (no HTTP options)."""
    root = args.model or DEFAULT_MODEL
    return ServerSettings(model_name=args.served_model_name or str(root), model_root=str(root))


async def run_on_engine(
    engine: AsyncLLM,
    settings: ServerSettings,
    requests: Requests,
    output_path: str | os.PathLike[str],
    options: BatchOptions,
) -> BatchSummary:
    return await BatchRunner(EngineTarget(ServerState(settings, engine)), output_path, options).run(requests)


async def run_on_llm_engine(
    args: EngineArgs,
    llm_engine: LLMEngine,
    requests: Requests,
    output_path: str | os.PathLike[str],
    options: BatchOptions,
) -> BatchSummary:
    """`LLM.run_batch`: the LLM's engine driven from this event loop for the length of the job, through an
    `AsyncLLM` on its core client and its processor (tokenizer, content filter, grammar checks), so
    nothing is read or built again (a second front end cost a second GGUF parse and tokenizer build)."""
    settings = settings_for(args)
    engine = AsyncLLM(
        args, served_model_name=settings.model_name, client=llm_engine.client, processor=llm_engine.processor
    )
    try:
        return await run_on_engine(engine, settings, requests, output_path, options)
    finally:
        await engine.shutdown(timeout=0, stop_core=False)
