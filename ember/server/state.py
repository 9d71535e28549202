"""What every endpoint shares: `ServerState`, kept on `app.state.ember`.

It lives apart from app.py so that the endpoint modules, which app.py imports to wire their routers,
can reach it without importing the app factory back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from ember.frontend.async_llm import AsyncLLM
from ember.server.args import ServerSettings
from ember.server.errors import APIError


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
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.settings.model_name}'",
                "not_found_error",
                "model",
                "model_not_found",
            )


def get_state(request: Request) -> ServerState:
    return request.app.state.ember
