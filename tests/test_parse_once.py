"""Each model file is parsed once per process, and each tokenizer built once: counted from the DEBUG lines
that `ember.model.reads` logs for every GGUF or JSON parse and tokenizer build, in whichever process does
it. On `ember serve` of the default model: the front end parses the GGUF and builds the tokenizer once;
the engine core parses the GGUF once (config and weights) and builds no tokenizer until the first
structured-output request needs its grammar vocabulary. `LLM.run_batch` reads and builds nothing: it
runs on the LLM's own engine."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
from conftest import free_port, wait_healthy

from ember.frontend import async_llm
from ember.model.reads import BUILT_TOKENIZER, PARSED_GGUF, PARSED_JSON, PREFIX

_READ = re.compile(rf"{PREFIX} ({PARSED_GGUF}|{PARSED_JSON}|{BUILT_TOKENIZER}) .* in [0-9.]+ s \(pid (\d+)\)")


def reads_by_process(log: str) -> dict[int, Counter]:
    """What each process read and built, from its log lines."""
    counts: dict[int, Counter] = {}
    for what, pid in _READ.findall(log):
        counts.setdefault(int(pid), Counter())[what] += 1
    return counts


@pytest.fixture
def serve(tmp_path):
    """`ember serve` of the default model, logging at DEBUG; yields (its pid, its URL, its log file)."""
    port, log = free_port(), tmp_path / "serve.log"
    env = {**os.environ, "EMBER_LOGGING_LEVEL": "DEBUG"}
    env.pop("EMBER_API_KEY", None)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ember.cli",
                "serve",
                "--port",
                str(port),
                "--kv-cache-memory",
                "0.25",
                "--max-model-len",
                "2048",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        yield proc.pid, url, log
    finally:
        proc.terminate()
        proc.wait(60)


def test_serve_parses_the_gguf_once_per_process_and_the_core_builds_its_tokenizer_on_demand(serve):
    front_end, url, log = serve
    started = reads_by_process(log.read_text())
    assert started.pop(front_end) == {PARSED_GGUF: 1, BUILT_TOKENIZER: 1}
    assert list(started.values()) == [{PARSED_GGUF: 1}]  # the engine core: config and weights in one parse

    r = httpx.post(
        url + "/v1/completions",
        timeout=120,
        json={
            "prompt": "Is the sky blue? Answer:",
            "max_tokens": 5,
            "temperature": 0,
            "structured_outputs": {"choice": ["yes", "no"]},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no")

    after = reads_by_process(log.read_text())
    assert after.pop(front_end) == {PARSED_GGUF: 1, BUILT_TOKENIZER: 1}
    assert list(after.values()) == [{PARSED_GGUF: 1, BUILT_TOKENIZER: 1}]  # from the vocabulary read with the weights


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _counted(calls: Counter, name: str, real: Callable) -> Callable:
    def call(*args, **kwargs):
        calls[name] += 1
        return real(*args, **kwargs)

    return call


def test_run_batch_builds_no_second_engine_or_tokenizer(default_llm, tmp_path, monkeypatch):
    """No core client, processor or model info for the job: it runs on the LLM's own (the in-process core
    here, so a model read or tokenizer build anywhere would show in this process's log)."""
    calls: Counter = Counter()
    for name in ("make_client", "Processor", "load_model_info"):
        monkeypatch.setattr(async_llm, name, _counted(calls, name, getattr(async_llm, name)))
    lines, logger = _Lines(), logging.getLogger("ember")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.DEBUG)
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
        summary = default_llm.run_batch(
            [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}],
            tmp_path / "out.jsonl",
            use_tqdm=False,
        )
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert (summary.succeeded, summary.failed) == (1, 0)
    assert not calls, calls
    assert not [line for line in lines.lines if line.startswith(PREFIX)]
