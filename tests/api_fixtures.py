"""What the agent-API tests share: a server of the default model with a tool-calling chat template,
a reader of named server-sent events, and the check that a server holds no request any more."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from conftest import DEVICE
from test_server import MODEL, ServerThread

from ember import AsyncLLM, EngineArgs

# A Hermes-style ChatML template (what Qwen's teaches): tools in the system turn, calls in <tool_call> tags.
TEMPLATE = """{%- if tools %}<|im_start|>system
Call tools as <tool_call>{"name": ..., "arguments": ...}</tool_call>. Tools:
{%- for t in tools %}
{{ t.function | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@contextmanager
def serve_default_model(tmp_path_factory: Any, **settings: Any) -> Iterator[ServerThread]:
    """The default model behind a real uvicorn, with the Hermes-style `TEMPLATE`."""
    template = tmp_path_factory.mktemp("template") / "template.jinja"
    template.write_text(TEMPLATE)
    args = EngineArgs(
        kv_cache_memory=0.25,
        max_model_len=2048,
        device=DEVICE,
        dtype="float32",
        chat_template=str(template),
        engine_process=False,
    )
    with ServerThread(AsyncLLM(args, served_model_name=MODEL), **settings) as s:
        yield s


def sse_events(response: httpx.Response) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) of each server-sent event of a streamed response."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: ") :])))
            name = None
    return events


def assert_no_request_left(server: ServerThread, timeout: float = 10.0) -> None:
    """Every request has ended: none running or waiting in the core, no KV block held, nothing in the
    front end's tables; and the server still answers."""
    engine = server.state.engine

    def held() -> tuple[int, int, float, int]:
        stats = engine.scheduler_stats  # None until the core has reported a step: then it holds nothing
        core = (0, 0, 0.0) if stats is None else (stats.num_running, stats.num_waiting, stats.kv_cache_usage)
        return (*core, engine.num_live_requests)

    deadline = time.monotonic() + timeout
    while held() != (0, 0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held() == (0, 0, 0, 0)
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
