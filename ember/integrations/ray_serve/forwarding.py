"""One HTTP request as it travels from the Ray Serve ingress to an Ember replica, and its replay there.

The replica runs Ember's own FastAPI app (ember.server.app) in process: the ingress forwards the
request's method, path, headers and body, and the replica feeds them to the app as one ASGI call,
streaming back the ASGI messages it sends. So every endpoint, error shape, API-key check and
stream behaves exactly as under `ember serve`, with nothing re-implemented.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prefix: str = ""  # the prompt's opening characters, which the router hashes ("" when there is no prompt)
    replica: str | None = None  # a replica id the caller pinned the request to


async def call_asgi(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[Message]:
    """Run `app` on `request`, yielding the `http.response.*` messages it sends.

    Closing the generator early (the client went away, so Ray cancelled the call) tells the app the
    client disconnected and cancels it, which aborts the engine request and frees its KV blocks.
    """
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(_scope(request), receive, send))  # an ASGI app returns an Awaitable
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            yield message
        task.result()  # the app's own failure, if it raised instead of answering
    finally:
        if not task.done():  # closed early
            disconnected.set()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "scheme": "http",
        "method": request.method,
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": None,
        "server": None,
    }
