"""The batch target for a running server (`ember run-batch --url`): each line is one POST.

It uses Ember's small HTTP/1.1 client (`ember.http_client`, one connection per request), so `--url`
needs nothing beyond Ember installed; any OpenAI-compatible server works. A connection that fails or
breaks before the whole answer arrived is a reply with status 0, which the runner retries.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ember.batch.runner import Reply
from ember.http_client import ProtocolError, http_request


class ServerTarget:
    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def __call__(self, url: str, data: dict[str, Any]) -> Reply:
        try:
            response = await http_request("POST", self.base_url + url, data, self.headers)
            try:
                raw = await response.read()
            finally:
                await response.close()
        except (OSError, ProtocolError, asyncio.IncompleteReadError) as e:
            return Reply(0, code="connection_error", message=f"{type(e).__name__}: {e}")
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):  # a proxy's HTML page, a cut answer: nothing to keep
            text = raw[:300].decode("utf-8", "replace")
            status = response.status if response.status >= 400 else 502
            body = {"error": {"message": f"not a JSON object: {text!r}", "type": "invalid_response"}}
            return Reply(status, body)
        return Reply(response.status, body, retry_after=_seconds(response.headers.get("retry-after")))


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:  # an HTTP date: the exponential delay will do
        return None
