"""The open endpoints: GET /health, /version and /metrics.

They need no API key, so that load balancers and Prometheus can reach them, and /health answers 503
while the model loads or the server drains, so traffic goes elsewhere until the engine can take it.
"""

from __future__ import annotations

import prometheus_client
from fastapi import APIRouter, Request
from fastapi.responses import Response

import ember
from ember.server.errors import APIError
from ember.server.openapi import VersionResponse, route_docs
from ember.server.plumbing import available_engine
from ember.server.state import get_state

router = APIRouter()


@router.get("/health", **route_docs(success={"description": "The engine is ready (an empty body)"}, errors=[503]))
async def health(request: Request) -> Response:
    try:
        available_engine(get_state(request))
    except APIError as e:
        return e.response()
    return Response(status_code=200)


@router.get("/version", **route_docs(response=VersionResponse))
async def version() -> dict[str, str]:
    return {"version": ember.__version__}


@router.get(
    "/metrics",
    **route_docs(
        success={
            "description": "Prometheus metrics (empty while the model loads)",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    ),
)
async def metrics(request: Request) -> Response:
    engine = get_state(request).engine
    body = prometheus_client.generate_latest(engine.metrics_registry) if engine is not None else b""
    return Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)
