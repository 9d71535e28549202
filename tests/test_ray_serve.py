"""Ember replicas on Ray Serve: a local Ray cluster, two CPU replicas of the default model, the `openai` client."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import ray
from conftest import default_gguf_path, free_port
from ray import serve

from ember.integrations.ray_serve import build_application, parse
from ember.integrations.ray_serve.ingress import routing_prefix
from ember.integrations.ray_serve.replica import REPLICA_HEADER

MODEL = "smollm2"
GREEDY = {"temperature": 0, "max_tokens": 4}
# Longer than --prefix-chars (256) and several 16-token KV blocks, so replicas can reuse it.
SHARED = "You are a terse assistant. Answer in one word. " * 12


@pytest.fixture(scope="module")
def url():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine_args, settings, options, _ = parse(
            [
                default_gguf_path(),
                "--served-model-name",
                MODEL,
                "--device",
                "cpu",
                "--kv-cache-memory",
                "0.05",
                "--max-model-len",
                "512",
                "--max-num-seqs",
                "4",
                "--num-replicas",
                "2",
                "--replica-cpus",
                "1",
                "--shutdown-timeout",
                "1",
            ]
        )
        serve.run(build_application(engine_args, settings, options), name="ember", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(client: openai.OpenAI, prompt: str, **overrides) -> tuple[str, str]:
    """(the text, the replica that answered)"""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, **{**GREEDY, **overrides})
    return raw.parse().choices[0].text, raw.headers[REPLICA_HEADER]


def _metric(url: str, replica: str, name: str) -> float:
    """A replica's own metric, read through the ingress pinned to it."""
    response = httpx.get(url + "/metrics", headers={REPLICA_HEADER: replica}, timeout=30)
    assert response.headers[REPLICA_HEADER] == replica
    return float(re.search(rf"^ember:{name}\{{[^}}]*\}} (\S+)$", response.text, re.MULTILINE).group(1))


def _replicas(client: openai.OpenAI) -> dict[str, str]:
    """Each replica and a prompt routed to it: distinct prompts hash to both within a few tries."""
    seen: dict[str, str] = {}
    for i in range(24):
        prompt = f"{i} is a number and"
        seen.setdefault(_complete(client, prompt)[1], prompt)
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only replicas {set(seen)} answered 24 distinct prompts")


def test_openai_client_through_the_ingress(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    full = client.completions.create(model=MODEL, prompt="The capital of France is", **GREEDY)
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is", stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text != ""
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    chunks = client.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):  # Ember's own errors pass through unchanged
        client.completions.create(model="other", prompt="x", **GREEDY)


def test_shared_prefix_lands_on_one_replica(url, client):
    replicas = _replicas(client)
    before = {r: _metric(url, r, "prefix_cache_hits_total") for r in replicas}
    answered = {_complete(client, f"{SHARED}Question {i}: what is {i} plus {i}?")[1] for i in range(4)}
    after = {r: _metric(url, r, "prefix_cache_hits_total") for r in replicas}
    assert len(answered) == 1
    (home,) = answered
    (other,) = set(replicas) - answered
    assert after[other] == before[other]
    assert after[home] - before[home] >= 3 * 16  # the later three each reuse at least one 16-token block


def test_routing_prefix_is_the_prompts_opening():
    assert routing_prefix("/v1/completions", b'{"prompt": "abcdef"}', 4) == "abcd"
    assert routing_prefix("/v1/completions", b'{"prompt": ["abc", "xyz"]}', 4) == "abc"  # a batch: its first
    assert routing_prefix("/v1/completions", b'{"prompt": [[5, 17], [9]]}', 9) == "5 17 "
    chat = (
        b'{"messages": [{"role": "system", "content": "Be brief."}, '
        b'{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}'
    )
    assert routing_prefix("/v1/chat/completions", chat, 100) == "system:Be brief.\nuser:Hi\n"
    assert routing_prefix("/v1/models", b"", 100) == routing_prefix("/v1/completions", b"[1,", 100) == ""


def test_killing_a_replica_loses_no_request_that_had_not_answered(url, client):
    prompts = _replicas(client)
    victim = min(prompts)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"]]
    assert len(names) == 1
    with ThreadPoolExecutor(1) as pool:
        # Running on the victim when it dies, with nothing sent back yet: the ingress retries it elsewhere.
        running = pool.submit(_complete, client, prompts[victim], max_tokens=64, extra_body={"ignore_eos": True})
        deadline = time.monotonic() + 60
        while _metric(url, victim, "num_requests_running") < 1:
            assert time.monotonic() < deadline and not running.done()
            time.sleep(0.02)
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        text, replica = running.result()
    assert text and replica != victim
    answered = [_complete(client, f"{i} is a number and") for i in range(6)]  # sent after the kill
    assert all(text for text, _ in answered)
    assert victim not in {replica for _, replica in answered}


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--num-replicas", "0"], "num_replicas must be >= 1"),
        (["--num-replicas", "3", "--max-replicas", "2"], "max_replicas (2) must be >= num_replicas (3)"),
        (["--prefix-chars", "0"], "prefix_chars must be >= 1"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
    ],
)
def test_bad_flags_are_one_clear_error(flags, needle, capsys):
    from ember.integrations.ray_serve.__main__ import main

    assert main(flags) == 2  # checked before it joins or starts a Ray cluster
    assert needle in capsys.readouterr().err
