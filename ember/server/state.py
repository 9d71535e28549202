"""What every endpoint shares: `ServerState`, kept on `app.state.ember`.

It lives apart from app.py so that the endpoint modules, which app.py imports to wire their routers,
can reach it without importing the app factory back.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fastapi import Request

from ember.frontend.async_llm import AsyncLLM
from ember.lora.request import LoRARequest
from ember.server.args import ServerSettings
from ember.server.errors import APIError
from ember.server.responses_store import ResponseStore


@dataclass
class ServerState:
    """What the endpoints share: the settings, the engine once loaded, and whether we are draining."""

    settings: ServerSettings
    engine: AsyncLLM | None = None
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # The Responses API's stored responses, and the background ones still running (by response id).
    response_store: ResponseStore = field(init=False)
    background_responses: dict[str, asyncio.Task[None]] = field(default_factory=dict, init=False)
    _closed: bool = field(default=False, init=False)
    # the LoRA adapters served as models, by name: --lora-modules, then POST /v1/load_lora_adapter
    loras: dict[str, LoRARequest] = field(default_factory=dict, init=False)
    _lora_ids: int = field(default=0, init=False)  # the last lora_int_id given: ids are never reused

    def __post_init__(self) -> None:
        s = self.settings
        self.response_store = ResponseStore(s.responses_store_path, s.responses_store_limits)
        for name, path in s.lora_modules:
            self.add_lora(name, path)

    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at `path` as model `name`, under a new id (so a name loaded again with other
        weights never meets its old prefix-cache entries or device slot)."""
        self._lora_ids += 1
        self.loras[name] = LoRARequest(name, self._lora_ids, path)
        return self.loras[name]

    def served_model(self, model: str | None) -> str:
        """The id an answer names: the adapter the request's `model` selected, else the base model's."""
        return model if model is not None and model in self.loras else self.settings.model_name

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (or no name); a 404 for a name not
        served (an adapter unloaded since the body was read)."""
        self.check_model(model)
        return None if model is None else self.loras.get(model)

    async def drain(self) -> None:
        """Refuse new work at once (health and new requests get 503), give running requests up to
        `shutdown_timeout` to finish, then abort the rest."""
        self.draining = True
        await self.close()

    async def close(self) -> None:
        """Stop the engine (running requests get `shutdown_timeout` to finish), then the background
        responses it did not finish (stored as cancelled), then the response store."""
        if self.engine is not None and not self._closed:
            self._closed = True
            await self.engine.shutdown(self.settings.shutdown_timeout)
        tasks = list(self.background_responses.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.response_store.close()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name and model not in self.loras:
            served = ", ".join(repr(m) for m in [self.settings.model_name, *self.loras])
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves {served}",
                "not_found_error",
                "model",
                "model_not_found",
            )


def get_state(request: Request) -> ServerState:
    return request.app.state.ember
