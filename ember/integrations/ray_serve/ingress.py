"""The one HTTP entry point in front of the replicas: forwards every request, streams included.

It parses nothing but the prompt's opening characters (the routing key) and never loads a model,
so it needs no CPU or GPU of its own (`num_cpus=0`). Ray's router already avoids replicas it knows
are dead; a request whose replica died after taking it but before sending anything back (killed,
its node lost) is retried here on another: the client has received nothing, so the rerun costs
only latency. A stream already under way ends with the connection, as with a dead `ember serve`.

No `from __future__ import annotations` here: Serve re-wraps the route methods and FastAPI must see
`Request` as a class, not a string, or it reads it as a query parameter (422). The helpers come
before the class because `serve.ingress` pickles the app, with what its routes refer to, at once.
"""

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import Message

from ember.integrations.ray_serve.forwarding import ForwardedRequest
from ember.integrations.ray_serve.replica import REPLICA_HEADER
from ember.server.errors import unavailable

logger = logging.getLogger("ember")
_ATTEMPTS = 3  # a replica that died before answering is retried on another, this many tries in all
_PROMPT_PATHS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}


async def _bodies(messages: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    async for message in messages:
        if message["type"] == "http.response.body" and message.get("body"):
            yield message["body"]


def routing_prefix(path: str, body: bytes, chars: int) -> str:
    """The first `chars` characters of the prompt (chat: the messages' roles and text in order; token
    ids: their decimal form), or "" for a request without one."""
    field = _PROMPT_PATHS.get(path)
    if field is None:
        return ""
    try:
        prompt = json.loads(body).get(field)
    except (ValueError, AttributeError):  # the replica answers the bad body with OpenAI's error
        return ""
    return _text(prompt)[:chars]


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return f"{value} "
    if isinstance(value, dict):  # a chat message, or a part of one's content
        if "role" in value:
            return f"{value['role']}:{_text(value.get('content'))}\n"
        return _text(value.get("text"))
    if isinstance(value, list):
        if value and isinstance(value[0], (str, list)):  # a batch of prompts: route by the first
            return _text(value[0])
        return "".join(_text(v) for v in value)
    return ""


app = FastAPI(title="Ember on Ray Serve", openapi_url=None)


@serve.ingress(app)
class EmberIngress:
    def __init__(self, replicas: DeploymentHandle, prefix_chars: int = 256) -> None:
        self.replicas = replicas.options(stream=True)
        self.prefix_chars = prefix_chars

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, request: Request) -> Response:
        body = await request.body()
        forwarded = ForwardedRequest(
            method=request.method,
            path=request.url.path,
            query_string=request.scope["query_string"],
            headers=list(request.scope["headers"]),
            body=body,
            prefix=routing_prefix(request.url.path, body, self.prefix_chars),
            replica=request.headers.get(REPLICA_HEADER),
        )
        try:
            messages, start = await self._start(forwarded)
        except RayActorError as e:
            return unavailable(f"no Ember replica could take the request ({type(e).__name__})").response()
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers", [])}
        return StreamingResponse(_bodies(messages), status_code=start["status"], headers=headers)

    async def _start(self, forwarded: ForwardedRequest) -> tuple[DeploymentResponseGenerator, Message]:
        attempt = 1
        while True:
            messages = self.replicas.forward.remote(forwarded)
            assert isinstance(messages, DeploymentResponseGenerator)  # self.replicas streams (stream=True)
            try:
                return messages, await messages.__anext__()
            except RayActorError as e:  # died or unreachable, before sending anything back
                if attempt == _ATTEMPTS:
                    raise
                attempt += 1
                logger.warning("replica lost before answering (%s); retrying on another", type(e).__name__)
