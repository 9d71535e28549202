"""The OpenAPI document (`/openapi.json`, shown by `/docs` and `/redoc`): what each route declares, in one place.

The endpoints read their JSON bodies themselves (plumbing.py's `read_body`, for size limits and
OpenAI-shaped errors), so FastAPI never sees the request models. `route_docs` gives a route's
decorator what the document needs instead: the request model as `openapi_extra`, a `$ref` into
`#/components/schemas`, the 200 model (and, for streaming endpoints, `text/event-stream` whose events
carry the chunk model as JSON), and the `ErrorResponse` answers the endpoint can give. `install`
then completes FastAPI's document with the schemas of the models that only those `$ref`s name,
and with a bearer security scheme when the server has an API key.

Every schema is pydantic's validation-mode one (FastAPI's `separate_input_output_schemas=False`
too), so a model has one schema wherever it appears; the response models' serializers only drop
None fields, which the validation schemas allow (in serialization mode `DeltaMessage`, whose
serializer drops them, would be any object). Streams use `itemSchema` for one event, as FastAPI's own
server-sent events do (OpenAPI 3.2's keyword in a 3.1 document; schemathesis checks each event by it).
Swagger UI (`/docs`) and ReDoc load their JavaScript from FastAPI's default CDN.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.models import Schema
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from ember.server.protocol import ErrorResponse

REF_TEMPLATE = "#/components/schemas/{model}"

# What each status means for the routes that declare it; every error body is an `ErrorResponse`.
ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a wrong field or value, or a prompt too long for the model",
    401: "Missing or wrong API key (only when the server has one: --api-key or $EMBER_API_KEY)",
    404: "The request's `model` is not the one this server serves",
    413: "The request body is larger than --max-request-body-bytes",
    429: "The engine's queue is full (--max-waiting-requests); retry after Retry-After seconds",
    500: "Internal error: a request failed inside the engine, or a bug",
    503: "The model is still loading, the engine is not running, or the server is shutting down; "
    "retry after Retry-After seconds",
}
# The groups of errors the routes share (see plumbing.py and errors.py for where each comes from).
ENGINE_ERRORS = (401, 500, 503)  # behind the API key, needs the loaded engine
BODY_ERRORS = (*ENGINE_ERRORS, 400, 404, 413)  # ... and reads a JSON body naming a `model`
GENERATION_ERRORS = (*BODY_ERRORS, 429)  # ... and queues engine requests

# The models only `$ref`s made here name, by component name: filled as the route modules are imported.
_referenced: dict[str, type[BaseModel]] = {}


class VersionResponse(BaseModel):
    """GET /version's answer."""

    version: str


class ResetPrefixCacheResponse(BaseModel):
    """POST /reset_prefix_cache's answer: false while requests hold KV blocks (the cache is then left as it is)."""

    reset: bool


def _ref(model: type[BaseModel]) -> dict[str, str]:
    name = model.__name__
    if _referenced.setdefault(name, model) is not model:
        raise ValueError(f"two models named {name} in the OpenAPI document")
    return {"$ref": REF_TEMPLATE.format(model=name)}


def error_responses(statuses: Iterable[int], model: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": model, "description": ERROR_DESCRIPTIONS[s]} for s in sorted(statuses)}


def route_docs(
    *,
    body: type[BaseModel] | None = None,
    response: type[BaseModel] | None = None,
    stream_chunk: type[BaseModel] | None = None,
    errors: Iterable[int] = (),
    success: dict[str, Any] | None = None,
    error_model: type[BaseModel] = ErrorResponse,
    stream_done: bool = True,
) -> dict[str, Any]:
    """The keyword arguments of a route decorator that document it.

    body: the JSON request body's model; the route reads it with `read_body`.
    response: the 200 answer's model (as `response_model`: a route returning a `Response` is not re-validated).
    stream_chunk: with `"stream": true` the 200 answer is server-sent events, each `data:` one of these as
        JSON (or an error when the request fails mid-stream), then `data: [DONE]` if `stream_done`.
    errors: the statuses of the error answers the route can give, each an `error_model`.
    success: the 200 answer as an OpenAPI response object, for one that no model describes (the
        route then returns its own `Response`, so FastAPI does not also document a JSON 200).
    """
    responses: dict[int | str, dict[str, Any]] = error_responses(errors, error_model)
    kwargs: dict[str, Any] = {"responses": responses}
    if response is not None:
        kwargs["response_model"] = response
    if success is not None:
        kwargs["response_class"] = Response
        responses[200] = success
    if stream_chunk is not None:
        responses[200] = {
            "content": {"text/event-stream": {"itemSchema": _event_schema(stream_chunk, error_model, stream_done)}},
            "description": 'The answer as JSON, or with `"stream": true` as server-sent events',
        }
    if body is not None:
        kwargs["openapi_extra"] = {
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
        }
    return kwargs


def _event_schema(chunk: type[BaseModel], error: type[BaseModel], done: bool) -> dict[str, Any]:
    """One server-sent event of a stream (the `itemSchema` of OpenAPI 3.2, as FastAPI writes it)."""
    data: list[dict[str, Any]] = [
        {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_ref(chunk), _ref(error)]},
        }
    ]
    if done:
        data.append({"const": "[DONE]", "description": "The stream's last event"})
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"anyOf": data},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer", "minimum": 0},
        },
    }


def install(app: FastAPI, *, api_key: bool) -> None:
    """Complete `app`'s generated document (each time FastAPI regenerates it) as described above."""
    generate: Callable[[], dict[str, Any]] = app.openapi
    completed: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        document = generate()
        if not completed or completed[0] is not document:  # FastAPI made a new one: the routes changed
            _complete(document, api_key)
            completed[:] = [document]
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def _complete(document: dict[str, Any], api_key: bool) -> None:
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    models = list(_referenced.values())
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF_TEMPLATE)
    for m in models:
        if refs[(m, "validation")] != {"$ref": REF_TEMPLATE.format(model=m.__name__)}:
            raise ValueError(f"pydantic names {m.__name__} {refs[(m, 'validation')]} in the OpenAPI document")
    for name, schema in defs.get("$defs", {}).items():
        if name in schemas and _as_fastapi_writes(schema) != schemas[name]:
            raise ValueError(f"two schemas named {name} in the OpenAPI document")
        # As pydantic writes it, also where FastAPI wrote the same model for a response (FastAPI's models
        # would make 2**63 - 1 a float and drop defaults): one model, one schema, whichever route names it.
        schemas[name] = schema
    _drop_path_validation_errors(document)
    if api_key:
        document["components"].setdefault("securitySchemes", {})["bearer"] = {"type": "http", "scheme": "bearer"}
        for operations in document.get("paths", {}).values():
            for operation in operations.values():
                if "401" in operation.get("responses", {}):  # the routes behind the key
                    operation["security"] = [{"bearer": []}]


def _drop_path_validation_errors(document: dict[str, Any]) -> None:
    """FastAPI documents a 422 for every route with parameters; a route whose only parameters are path
    strings (`/v1/responses/{response_id}`) can never answer one, since any path segment is a string."""
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            params = operation.get("parameters", [])
            if params and all(p["in"] == "path" and p["schema"].get("type") == "string" for p in params):
                operation.get("responses", {}).pop("422", None)
    if not any("422" in op.get("responses", {}) for ops in document.get("paths", {}).values() for op in ops.values()):
        for name in ("HTTPValidationError", "ValidationError"):
            document["components"]["schemas"].pop(name, None)


def _as_fastapi_writes(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema as FastAPI writes its own: through its OpenAPI models, with no null fields ("default": null)."""
    return jsonable_encoder(Schema.model_validate(schema), by_alias=True, exclude_none=True)
