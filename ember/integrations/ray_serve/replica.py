"""An Ember replica: one engine (`AsyncLLM`) and Ember's own FastAPI app, as a Ray Serve deployment."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray import serve
from starlette.types import Message

from ember.config import EngineArgs
from ember.frontend.async_llm import AsyncLLM
from ember.integrations.ray_serve.forwarding import ForwardedRequest, call_asgi
from ember.server.app import build_app
from ember.server.args import ServerSettings

REPLICA_HEADER = "x-ember-replica"


class EmberReplica:
    def __init__(
        self, engine_args: EngineArgs, settings: ServerSettings, max_waiting_requests: int | None = None
    ) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        engine = AsyncLLM(engine_args, max_waiting_requests=max_waiting_requests, served_model_name=settings.model_name)
        self.app = build_app(settings, engine)
        self.state = self.app.state.ember

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[Message]:
        """The app's response messages; the first (`http.response.start`) also names this replica."""
        async for message in call_asgi(self.app, request):
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica_id.encode())]
                message = {**message, "headers": headers}
            yield message

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine core died."""
        if self.state.engine.dead_reason is not None:
            raise RuntimeError(f"Ember engine stopped: {self.state.engine.dead_reason}")

    async def __del__(self) -> None:
        """On scale-down or shutdown: running requests get `--shutdown-timeout` to finish. (Serve calls
        this after a failed `__init__` too, when there is no engine to drain.)"""
        if hasattr(self, "state"):
            await self.state.drain()
