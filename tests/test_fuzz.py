"""The server's OpenAPI document, and schemathesis fuzzing every operation it lists on a running server.

The fuzzer reads /openapi.json from a real uvicorn over a tiny checkpoint, sends each operation
generated bodies (valid ones, and invalid ones: wrong types, missing fields, out-of-range numbers)
and requires that none gets a 5xx, that every answer matches the document (status, content type,
body), and that afterwards no request is left in the engine or its front end. Examples are bounded
and derandomized with a fixed seed, so CI runs the same cases every time, in about a minute on 2 CPUs.
"""

from __future__ import annotations

import os
import time

import hypothesis
import pytest
import schemathesis
from fastapi.testclient import TestClient
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from test_server import MODEL, ServerThread, tiny_engine

from ember.server import anthropic_messages, chat, completions, embeddings, health, models, responses, score
from ember.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from ember.server.app import build_app
from ember.server.args import ServerSettings, add_serve_parser, resolve_args, settings_from_args
from ember.server.embeddings import EmbeddingRequest
from ember.server.openapi import REF_TEMPLATE
from ember.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from ember.server.responses_protocol import ResponsesRequest
from ember.server.score import RerankRequest, ScoreRequest

# Every route the app has, and the model of the body it reads (None: no body).
ROUTES = {
    ("GET", "/health"): None,
    ("GET", "/version"): None,
    ("GET", "/metrics"): None,
    ("GET", "/v1/models"): None,
    ("POST", "/tokenize"): TokenizeRequest,
    ("POST", "/detokenize"): DetokenizeRequest,
    ("POST", "/reset_prefix_cache"): None,
    ("POST", "/v1/completions"): CompletionRequest,
    ("POST", "/v1/chat/completions"): ChatCompletionRequest,
    ("POST", "/v1/responses"): ResponsesRequest,
    ("GET", "/v1/responses/{response_id}"): None,
    ("DELETE", "/v1/responses/{response_id}"): None,
    ("POST", "/v1/responses/{response_id}/cancel"): None,
    ("POST", "/v1/messages"): MessagesRequest,
    ("POST", "/v1/messages/count_tokens"): CountTokensRequest,
    ("POST", "/v1/embeddings"): EmbeddingRequest,
    ("POST", "/v1/score"): ScoreRequest,
    ("POST", "/v1/rerank"): RerankRequest,
    ("POST", "/rerank"): RerankRequest,
}
ROUTE_MODULES = (chat, completions, embeddings, score, health, models, responses, anthropic_messages)
# Per operation, for the fuzzing phase; the coverage phase adds its own boundary cases. A deeper local
# run, other cases each time: EMBER_FUZZ_EXAMPLES=1000 EMBER_FUZZ_SEED=$RANDOM pytest tests/test_fuzz.py
MAX_EXAMPLES = int(os.environ.get("EMBER_FUZZ_EXAMPLES", "100"))
SEED = os.environ.get("EMBER_FUZZ_SEED")
MAX_MODEL_LEN = 48  # every generation stops within this many tokens, whatever max_tokens says


def _settings(**kwargs) -> ServerSettings:
    return ServerSettings(**{"model_name": MODEL, "model_root": "tiny-dir", **kwargs})


def _resolve(document: dict, ref: str) -> dict:
    assert ref.startswith("#/components/schemas/"), ref
    return document["components"]["schemas"][ref.rsplit("/", 1)[1]]


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        return ([node["$ref"]] if isinstance(node.get("$ref"), str) else []) + [
            r for v in node.values() for r in _refs(v)
        ]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


# ---- the document ---------------------------------------------------------------------------


def test_openapi_lists_every_route_with_its_request_and_response_schemas():
    app = build_app(_settings())
    client = TestClient(app)
    doc = client.get("/openapi.json").json()
    docs_page = client.get("/docs")
    assert doc["info"]["title"] == "Ember"
    listed = {(method.upper(), path): op for path, ops in doc["paths"].items() for method, op in ops.items()}
    routed = {(m, r.path) for module in ROUTE_MODULES for r in module.router.routes for m in r.methods}
    assert set(listed) == routed == set(ROUTES)
    for key, model in ROUTES.items():
        op = listed[key]
        if model is None:
            assert "requestBody" not in op, key
        else:  # the model read_body validates against, exactly as pydantic writes it
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            expected = model.model_json_schema(ref_template=REF_TEMPLATE)
            for name, sub in expected.pop("$defs", {}).items():
                assert doc["components"]["schemas"][name] == sub, name
            assert _resolve(doc, schema["$ref"]) == expected, key
            assert op["requestBody"]["required"] is True
        assert "422" not in op["responses"], key  # FastAPI validates nothing here: bad bodies are 400s
        assert op["responses"]["200"], key
        error_model = "AnthropicError" if key[1].startswith("/v1/messages") else "ErrorResponse"
        for status, response in op["responses"].items():
            if status != "200":
                assert response["content"]["application/json"]["schema"] == {
                    "$ref": f"#/components/schemas/{error_model}"
                }, (key, status)
    # Each answer's model, and streams as server-sent events of their chunk model.
    for key, name in [
        (("POST", "/v1/completions"), "CompletionResponse"),
        (("GET", "/v1/models"), "ModelList"),
        (("POST", "/v1/chat/completions"), "ChatCompletionResponse"),
        (("POST", "/tokenize"), "TokenizeResponse"),
        (("POST", "/detokenize"), "DetokenizeResponse"),
        (("POST", "/v1/responses"), "ResponseObject"),
        (("GET", "/v1/responses/{response_id}"), "ResponseObject"),
        (("POST", "/v1/messages"), "MessagesResponse"),
        (("POST", "/v1/messages/count_tokens"), "CountTokensResponse"),
    ]:
        assert listed[key]["responses"]["200"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{name}"
        }
    for key, chunk in [
        (("POST", "/v1/completions"), "CompletionResponse"),
        (("POST", "/v1/chat/completions"), "ChatCompletionChunk"),
        (("POST", "/v1/responses"), "ResponseStreamEvent"),
        (("POST", "/v1/messages"), "MessageStreamEvent"),
    ]:
        events = listed[key]["responses"]["200"]["content"]["text/event-stream"]["itemSchema"]
        assert {"$ref": f"#/components/schemas/{chunk}"} in events["properties"]["data"]["anyOf"][0]["contentSchema"][
            "anyOf"
        ]
        assert set(listed[key]["responses"]) == {"200", "400", "401", "404", "413", "429", "500", "503"}
    assert set(listed[("GET", "/health")]["responses"]) == {"200", "503"}
    assert "content" not in listed[("GET", "/health")]["responses"]["200"]
    assert list(listed[("GET", "/metrics")]["responses"]["200"]["content"]) == ["text/plain"]
    for ref in _refs(doc):  # nothing dangles
        _resolve(doc, ref)
    assert "securitySchemes" not in doc.get("components", {})  # no API key: nothing to authorize
    # Swagger UI over this document (its JS and CSS come from FastAPI's default CDN).
    assert docs_page.status_code == 200 and "swagger-ui" in docs_page.text and "/openapi.json" in docs_page.text


def test_openapi_with_an_api_key_declares_bearer_auth_and_stays_open():
    app = build_app(_settings(api_keys=("sekrit",)))
    client = TestClient(app)
    doc = client.get("/openapi.json").json()  # the document needs no key, like /health
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 503  # no engine
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    secured = {path for path, ops in doc["paths"].items() for op in ops.values() if "security" in op}
    assert secured == {
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/reset_prefix_cache",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/embeddings",
        "/v1/score",
        "/v1/rerank",
        "/rerank",
    }


def _serve_settings(argv: list[str]) -> ServerSettings:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return settings_from_args(resolve_args(parser.parse_args(["serve", *argv])))[1]


@pytest.mark.parametrize("how", ["flag", "yaml"])
def test_disable_fastapi_docs_removes_the_document_and_its_pages(how, tmp_path):
    assert _serve_settings([]).fastapi_docs is True
    if how == "flag":
        settings = _serve_settings(["--disable-fastapi-docs"])
    else:
        config = tmp_path / "serve.yaml"
        config.write_text("disable_fastapi_docs: true\n")
        settings = _serve_settings(["--config", str(config)])
    assert settings.fastapi_docs is False
    app = build_app(settings)
    client = TestClient(app)
    for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):
        r = client.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
    assert client.get("/version").status_code == 200


# ---- fuzzing a running server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzzed_server(llama_dir):
    with ServerThread(tiny_engine(llama_dir, max_model_len=MAX_MODEL_LEN)) as s:
        yield s


CONFIG = {
    "seed": int(SEED or 26),
    "generation": {"max-examples": MAX_EXAMPLES, "deterministic": SEED is None, "database": "none"},
    "phases": {"stateful": {"enabled": False}},  # no links between operations to follow
    "request-timeout": 60,
    # Events of a stream read and checked; a longer stream is left early, as a client that disconnects.
    "max-stream-events": 64,
}


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(
        fuzzed_server.url + "/openapi.json", config=schemathesis.Config.from_dict(CONFIG)
    )


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture
def _schemathesis_node_id(request):
    """schemathesis 4.32's `from_fixture` tests read and rename `request.node._nodeid`, which pytest 9.2
    no longer has (its node ids became `Node._id`); give them one."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


@pytest.mark.usefixtures("_schemathesis_node_id")
@schema.parametrize()
@hypothesis.settings(deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
def test_fuzz_every_operation(case):
    case.call_and_validate(
        checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    )


def test_fuzzing_left_no_request_behind(fuzzed_server):
    """Every request the fuzzer sent has ended: none running or waiting in the core, no KV block
    held, nothing left in the front end's tables."""
    engine = fuzzed_server.state.engine
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = engine.scheduler_stats
        if (
            engine.num_live_requests == 0
            and stats is not None
            and stats.num_running == stats.num_waiting == 0
            and stats.kv_cache_usage == 0
        ):
            break
        time.sleep(0.05)
    stats = engine.scheduler_stats
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0)
    assert engine.num_live_requests == 0  # the front end's streams and output states
    assert fuzzed_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
