"""Soak: `ember serve` under steady mixed load for a long time; memory, KV cache, latency and errors over time.

The script starts `ember serve` itself (its own process group, on a free port; the default model on
CPU unless `--model` or the flags after `--` say otherwise), waits for `/health` = 200, sends every
malformed body of its set once, then drives the server for `--duration` seconds with `--concurrency`
closed-loop clients (asyncio + httpx, one connection each; a client sends its next request as soon as
its last one ended). A client's request is, by draw:

- malformed (`--malformed-fraction`): the next body of a rotating set of bad requests (invalid JSON,
  wrong types, out-of-range values, unknown model, empty messages, deep nesting, a bad grammar, a body
  over the size limit, ...); each must get a 4xx;
- otherwise a streaming chat or completion request (`--chat-fraction`; completions send token ids,
  and a model without a tokenizer gets no chat) with a random prompt (`--prompt-len`) and
  `max_tokens` (`--max-tokens`), varied sampling settings, `ignore_eos`; of these
  `--cancel-fraction` are cancelled mid-stream: the client closes the connection after a random
  number of output chunks.

Every `--scrape-interval` seconds it scrapes `/metrics` and samples the server's process tree (front
end, engine core, their children), and records what the clients saw in that interval. At the end it
waits for the server to go idle, checks the targets, sends SIGTERM and times the exit, prints a table,
and writes `benchmarks/results/soak-<device>-<date>.json` (and a PNG with matplotlib). The exit
status is 1 when a target failed, 2 when the server did not start.

    python benchmarks/soak.py                                          # 20 minutes, default model, CPU
    python benchmarks/soak.py --duration 60 --concurrency 8            # quick
    python benchmarks/soak.py --model benchmarks/configs/qwen3-0.6b -- --load-format dummy   # GPU, random weights

Everything after `--` goes to `ember serve` unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    READY_LINE_DEVICE,
    RESULTS_DIR,
    free_port,
    machine_info,
    server_benchmark_parser,
    server_command,
    today,
    wait_ready,
    write_json,
)
from benchmarks.startup import process_tree, rss_mib
from ember.bench.machine import load_average
from ember.bench.report import percentile
from ember.bench.workloads import TOKEN_ID_LOW, WORDS
from ember.http_client import CHAT, COMPLETIONS, carries_output, error_message

try:
    import httpx
except ImportError:  # a test dependency of Ember, not a runtime one; --help works without it
    httpx = None
try:
    import psutil
except ImportError:
    psutil = None

# What happened to one request. "lost": neither finished, nor cancelled by us, nor answered with an
# error: a 200 stream that ended without [DONE], or anything still open after --request-timeout.
OUTCOMES = (
    "completed",
    "cancelled",
    "malformed_4xx",
    "malformed_accepted",
    "server_error",
    "unexpected_4xx",
    "transport_error",
    "lost",
)
SERVER_ERROR_TYPES = ("internal_server_error", "service_unavailable", "server_error")
ERRORS_KEPT = 20
KV_POOL_PASSES = 2  # on CPU, RSS is compared only after the engine wrote this many times its KV pool's tokens
_KV_POOL = re.compile(r"serving .*: (\d+) KV blocks of (\d+) tokens(?: \(([\d.]+) GiB\))?")
MIB = 2**20


# ---- malformed requests -------------------------------------------------------------------------


def malformed_bodies(model: str, max_model_len: int | None, body_limit: int) -> list[tuple[str, str, bytes]]:
    """(name, endpoint, raw body) of each bad request; every one must be answered with a 4xx."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
    comp = {"model": model, "prompt": [TOKEN_ID_LOW, TOKEN_ID_LOW + 1, TOKEN_ID_LOW + 2], "max_tokens": 4}

    def with_(base: dict[str, Any], **fields: Any) -> dict[str, Any]:
        return {**base, **fields}

    def without(base: dict[str, Any], key: str) -> dict[str, Any]:
        return {k: v for k, v in base.items() if k != key}

    depth = 20000
    deep = (
        b'{"model": ' + json.dumps(model).encode() + b', "max_tokens": 4, "messages": [{"role": "user", '
        b'"content": ' + b"[" * depth + b"]" * depth + b"}]}"
    )
    too_long = (max_model_len or 100_000) + 1
    oversize = body_limit + MIB
    cases: list[tuple[str, str, Any]] = [
        ("invalid_json", CHAT, json.dumps(chat).encode()[:-7]),
        ("not_utf8", CHAT, json.dumps(chat).replace("Say hi", "@@").encode().replace(b"@@", b"\xff\xfe\xfa")),
        ("body_not_object", CHAT, b"[1, 2, 3]"),
        ("empty_body", COMPLETIONS, b""),
        ("max_tokens_string", CHAT, with_(chat, max_tokens="ten")),
        ("messages_string", CHAT, with_(chat, messages="hello")),
        ("prompt_object", COMPLETIONS, with_(comp, prompt={"text": "hi"})),
        ("temperature_string", COMPLETIONS, with_(comp, temperature="hot")),
        ("stop_number", CHAT, with_(chat, stop=5)),
        ("negative_max_tokens", COMPLETIONS, with_(comp, max_tokens=-5)),
        ("negative_temperature", CHAT, with_(chat, temperature=-1.0)),
        ("top_p_above_one", COMPLETIONS, with_(comp, top_p=1.5)),
        ("huge_seed", COMPLETIONS, with_(comp, seed=10**20)),
        ("huge_top_k", CHAT, with_(chat, top_k=10**20)),
        ("n_too_large", COMPLETIONS, with_(comp, n=100_000)),
        ("logprobs_too_many", COMPLETIONS, with_(comp, logprobs=100_000)),
        ("top_logprobs_without_logprobs", CHAT, with_(chat, top_logprobs=5)),
        ("unknown_model", CHAT, with_(chat, model="no-such-model")),
        ("empty_messages", CHAT, with_(chat, messages=[])),
        ("bad_role", CHAT, with_(chat, messages=[{"role": "wizard", "content": "hi"}])),
        ("missing_prompt", COMPLETIONS, without(comp, "prompt")),
        ("token_id_out_of_vocab", COMPLETIONS, with_(comp, prompt=[10**9])),
        ("negative_token_id", COMPLETIONS, with_(comp, prompt=[-1])),
        ("prompt_too_long", COMPLETIONS, with_(comp, prompt=[TOKEN_ID_LOW] * too_long)),
        ("deep_nesting", CHAT, deep),
        ("grammar_empty", COMPLETIONS, with_(comp, structured_outputs={"grammar": ""})),
        ("regex_unclosed", CHAT, with_(chat, structured_outputs={"regex": "(abc"})),
        ("json_schema_bad_type", CHAT, with_(chat, structured_outputs={"json": {"type": "no-such-type"}})),
        (
            "two_constraints",
            CHAT,
            with_(chat, response_format={"type": "json_object"}, structured_outputs={"regex": "a+"}),
        ),
        ("oversized_body", COMPLETIONS, with_(comp, prompt="a " * (oversize // 2))),
    ]
    return [
        (name, endpoint, body if isinstance(body, bytes) else json.dumps(body).encode())
        for name, endpoint, body in cases
    ]


# ---- one request ---------------------------------------------------------------------------------


@dataclass
class Record:
    kind: str  # "chat", "completion" or "malformed"
    variant: str  # the malformed body's name; "stream" or "cancel" otherwise
    start: float  # seconds after the load started
    end: float = 0.0
    outcome: str = "lost"
    status: int | None = None
    ttft: float | None = None  # seconds, to the first chunk that carries output
    e2e: float | None = None  # seconds, to [DONE]
    output_tokens: int = 0  # usage.completion_tokens of a completed request (else output chunks)
    error: str | None = None


async def stream_request(
    client: Any, url: str, body: dict[str, Any], chat: bool, cancel_after: int | None, rec: Record
) -> None:
    start = time.perf_counter()
    chunks = 0
    usage_tokens = None
    async with client.stream("POST", url, json=body) as resp:
        rec.status = resp.status_code
        if resp.status_code != 200:
            rec.error = f"HTTP {resp.status_code}: {error_message(await resp.aread())}"
            rec.outcome = "server_error" if resp.status_code >= 500 else "unexpected_4xx"
            return
        try:
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    rec.e2e = time.perf_counter() - start
                    rec.output_tokens = usage_tokens if usage_tokens is not None else chunks
                    rec.outcome = "completed"
                    return
                chunk = json.loads(data)
                if chunk.get("error"):
                    err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                    rec.error = f"error event ({err.get('type')}): {str(err.get('message'))[:300]}"
                    rec.outcome = "server_error" if err.get("type") in SERVER_ERROR_TYPES else "unexpected_4xx"
                    return
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens", usage_tokens)
                for choice in chunk.get("choices") or ():
                    if carries_output(choice, chat):
                        if rec.ttft is None:
                            rec.ttft = time.perf_counter() - start
                        chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    rec.outcome = "cancelled"  # leaving the `async with` closes the connection mid-stream
                    rec.output_tokens = chunks
                    return
        except httpx.TransportError as e:  # the connection broke inside a 200 stream
            rec.error = f"stream broken after {chunks} chunks: {type(e).__name__}: {e}"
            rec.outcome = "lost"
            return
    rec.error = f"stream ended without [DONE] after {chunks} chunks"
    rec.outcome = "lost"


async def malformed_request(client: Any, url: str, payload: bytes, rec: Record) -> None:
    resp = await client.post(url, content=payload, headers={"Content-Type": "application/json"})
    rec.status = resp.status_code
    if 400 <= resp.status_code < 500:
        rec.outcome = "malformed_4xx"
    elif resp.status_code >= 500:
        rec.outcome = "server_error"
        rec.error = f"HTTP {resp.status_code} for {rec.variant}: {error_message(resp.content)}"
    else:
        rec.outcome = "malformed_accepted"
        rec.error = f"HTTP {resp.status_code} for {rec.variant}"


# ---- the load --------------------------------------------------------------------------------------


class Load:
    """The clients, the scraper and what they recorded."""

    def __init__(
        self,
        args: argparse.Namespace,
        base_url: str,
        model: str,
        chat_ok: bool,
        server_pid: int,
        malformed: list[tuple[str, str, bytes]],
    ) -> None:
        self.args = args
        self.base_url = base_url
        self.model = model
        self.chat_fraction = args.chat_fraction if chat_ok else 0.0
        self.server_pid = server_pid
        self.malformed = malformed
        self.next_malformed = itertools.count()
        self.records: list[Record] = []
        self.samples: list[dict[str, Any]] = []
        self.in_flight = 0
        self.workers: list[Any] = []  # --client-processes > 1: the processes that run the client loops
        self.worker_in_flight: Any = None  # their in-flight counts (a shared array)
        self.t0 = 0.0
        self.deadline = 0.0
        self.headers = (
            {"Authorization": f"Bearer {os.environ['EMBER_API_KEY']}"} if os.environ.get("EMBER_API_KEY") else {}
        )
        self._last_counters: dict[str, float] | None = None
        self._last_sample_t = 0.0
        self._seen = 0
        self._sweep_t0 = 0.0
        self._last_cpu: tuple[float, float] | None = None
        self.kv_pool_tokens: int | None = None  # KV blocks x block size, from the server's ready line
        self._engine_tokens = 0.0  # prompt + generated tokens so far (/metrics)

    def body(self, rng: random.Random, chat: bool) -> dict[str, Any]:
        a = self.args
        n_in = rng.randint(*a.prompt_len)
        n_out = rng.randint(*a.max_tokens)
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": n_out,
            "ignore_eos": a.ignore_eos,
        }
        if chat:
            body["messages"] = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(n_in))}]
            if rng.random() < 0.3:
                body["messages"].insert(0, {"role": "system", "content": "You are a terse assistant."})
        else:
            body["prompt"] = [rng.randrange(TOKEN_ID_LOW, a.vocab_size) for _ in range(n_in)]
        sampling = rng.choice(("greedy", "default", "top_p", "top_k", "seeded"))
        if sampling == "greedy":
            body["temperature"] = 0.0
        elif sampling == "top_p":
            body.update(temperature=0.8, top_p=0.9)
        elif sampling == "top_k":
            body.update(temperature=1.0, top_k=40)
        elif sampling == "seeded":
            body.update(temperature=0.7, seed=rng.randrange(2**31))
        return body

    async def one(self, client: Any, rng: random.Random) -> Record:
        a = self.args
        start = time.perf_counter()
        if rng.random() < a.malformed_fraction:
            name, endpoint, payload = self.malformed[next(self.next_malformed) % len(self.malformed)]
            rec = Record("malformed", name, start - self.t0)
            work = malformed_request(client, self.base_url + endpoint, payload, rec)
        else:
            chat = rng.random() < self.chat_fraction
            body = self.body(rng, chat)
            cancel_after = rng.randint(1, max(1, body["max_tokens"] - 1)) if rng.random() < a.cancel_fraction else None
            rec = Record(
                "chat" if chat else "completion", "stream" if cancel_after is None else "cancel", start - self.t0
            )
            work = stream_request(
                client, self.base_url + (CHAT if chat else COMPLETIONS), body, chat, cancel_after, rec
            )
        self.in_flight += 1
        try:
            await asyncio.wait_for(work, a.request_timeout)
        except asyncio.TimeoutError:  # before OSError: it is one since Python 3.11
            rec.outcome, rec.error = "lost", f"{rec.kind} request still open after {a.request_timeout:g} s"
        except httpx.TransportError as e:
            rec.outcome, rec.error = "transport_error", f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - bad JSON in a stream and the like: the server's fault, recorded
            rec.outcome, rec.error = "lost", f"{type(e).__name__}: {e}"
        finally:
            self.in_flight -= 1
        rec.end = time.perf_counter() - self.t0
        self.records.append(rec)
        return rec

    async def client_loop(self, i: int) -> None:
        rng = random.Random(self.args.seed * 100_003 + i)
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        timeout = httpx.Timeout(None, connect=30.0)  # the wall-clock --request-timeout is asyncio's
        async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=self.headers) as client:
            while time.perf_counter() < self.deadline:
                await self.one(client, rng)

    async def start_workers(self) -> None:
        """Run the client loops in --client-processes processes; their records arrive through a queue.

        One Python process parsing every SSE chunk tops out near 10k chunks/s (95% of a core in the
        H200 soak of 2026-12-04 at 256 clients): past that the client, not the server, sets the pace.
        perf_counter is CLOCK_MONOTONIC on Linux, so the workers' times share this process's t0.
        """
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        n = self.args.client_processes
        self.worker_in_flight = ctx.Array("i", n, lock=False)
        shares = [range(self.args.concurrency)[k::n] for k in range(n)]
        self.workers = [
            ctx.Process(
                target=_client_worker,
                daemon=True,
                args=(
                    self.args,
                    self.base_url,
                    self.model,
                    self.chat_fraction,
                    self.malformed,
                    list(share),
                    k,
                    self.t0,
                    self.deadline,
                    queue,
                    self.worker_in_flight,
                ),
            )
            for k, share in enumerate(shares)
        ]
        for w in self.workers:
            w.start()
        receiver = threading.Thread(target=self._receive, args=(queue, n), daemon=True)
        receiver.start()
        await asyncio.to_thread(receiver.join)
        for w in self.workers:
            await asyncio.to_thread(w.join)

    def _receive(self, queue: Any, workers: int) -> None:
        """Records from the workers until each has sent its final None."""
        while workers:
            batch = queue.get()
            if batch is None:
                workers -= 1
            else:
                self.records.extend(batch)

    # ---- sampling -----------------------------------------------------------------------------

    def server_memory(self) -> dict[str, Any]:
        """Resident memory of the server's process tree (front end, engine core, their children)."""
        if psutil is None:
            tree = process_tree(self.server_pid)
            return {
                "rss_mib": round(rss_mib(tree), 1),
                "rss_mib_front_end": round(rss_mib([self.server_pid]), 1),
                "processes": len(tree),
                "open_fds": None,
                "threads": None,
                "pids": tree,
            }
        try:
            root = psutil.Process(self.server_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return {
                "rss_mib": None,
                "rss_mib_front_end": None,
                "processes": 0,
                "open_fds": None,
                "threads": None,
                "pids": [],
            }
        total = front = 0
        fds = threads = 0
        alive = []
        for p in procs:
            try:
                with p.oneshot():
                    rss = p.memory_info().rss
                    fds += p.num_fds()
                    threads += p.num_threads()
            except psutil.Error:
                continue
            alive.append(p.pid)
            total += rss
            if p.pid == self.server_pid:
                front = rss
        return {
            "rss_mib": round(total / MIB, 1),
            "rss_mib_front_end": round(front / MIB, 1),
            "processes": len(alive),
            "open_fds": fds,
            "threads": threads,
            "pids": alive,
        }

    async def scrape(self, client: Any) -> dict[str, Any]:
        """Gauges and counters of /metrics (prometheus_client's text parser)."""
        from prometheus_client.parser import text_string_to_metric_families

        resp = await client.get(self.base_url + "/metrics", timeout=30.0)
        resp.raise_for_status()
        values: dict[str, float] = collections.defaultdict(float)
        for family in text_string_to_metric_families(resp.text):
            for sample in family.samples:
                if sample.name.endswith(("_bucket", "_created")):
                    continue
                values[sample.name] += sample.value  # summed over labels (model, finish reason)
        return dict(values)

    async def sample(self, client: Any, phase: str) -> dict[str, Any]:
        now = time.perf_counter() - self.t0
        dt = now - self._last_sample_t
        s: dict[str, Any] = {"t": round(now, 2), "dt": round(dt, 2), "phase": phase}
        mem = self.server_memory()
        cpu = _cpu_seconds(mem.pop("pids"))
        client_cpu = sum(os.times()[:2]) + _cpu_seconds([w.pid for w in self.workers])
        s.update(mem)
        # CPU the server's processes and this client got: on a shared machine, what the server could use
        if self._last_cpu is not None and dt > 0:
            s["server_cpu_pct"] = round(max(0.0, cpu - self._last_cpu[0]) / dt * 100, 1)
            s["client_cpu_pct"] = round((client_cpu - self._last_cpu[1]) / dt * 100, 1)
        else:
            s["server_cpu_pct"] = s["client_cpu_pct"] = None
        self._last_cpu = (cpu, client_cpu)
        try:
            m = await self.scrape(client)
            s["scrape_error"] = None
        except Exception as e:  # noqa: BLE001 - a failed scrape is a data point, not the end of the run
            m, s["scrape_error"] = None, f"{type(e).__name__}: {e}"
        if m is not None:
            kv = m.get("ember:kv_cache_usage_perc")
            s["kv_cache_usage_pct"] = None if kv is None else round(100 * kv, 2)
            s["running"] = m.get("ember:num_requests_running")
            s["waiting"] = m.get("ember:num_requests_waiting")
            s["live"] = None if s["running"] is None or s["waiting"] is None else s["running"] + s["waiting"]
            counters = {
                k: m.get(f"ember:{k}_total")
                for k in ("generation_tokens", "prompt_tokens", "num_preemptions", "request_success")
            }
            last = self._last_counters
            for k, v in counters.items():
                s[f"server_{k}"] = None if v is None or last is None or last.get(k) is None else v - last[k]
            s["server_generation_tok_s"] = (
                None
                if s["server_generation_tokens"] is None or dt <= 0
                else round(s["server_generation_tokens"] / dt, 1)
            )
            self._last_counters = counters
            self._engine_tokens += (s["server_prompt_tokens"] or 0) + (s["server_generation_tokens"] or 0)
            s["kv_pool_passes"] = round(self._engine_tokens / self.kv_pool_tokens, 3) if self.kv_pool_tokens else None
        else:
            s.update(kv_cache_usage_pct=None, running=None, waiting=None, live=None, server_generation_tok_s=None)
        s["client_in_flight"] = self.in_flight + (sum(self.worker_in_flight) if self.workers else 0)
        recs = self.records[self._seen :]
        self._seen = len(self.records)
        counts = collections.Counter(r.outcome for r in recs)
        for outcome in OUTCOMES:
            s[outcome] = counts.get(outcome, 0)
        done = [r for r in recs if r.outcome == "completed"]
        for key in ("e2e", "ttft"):
            values = sorted(getattr(r, key) for r in done if getattr(r, key) is not None)
            s[f"p50_{key}_s"] = round(percentile(values, 50), 3) if values else None
            s[f"p99_{key}_s"] = round(percentile(values, 99), 3) if values else None
        s["output_tokens"] = sum(r.output_tokens for r in done)
        s["output_tok_s"] = round(s["output_tokens"] / dt, 1) if dt > 0 else None
        s["loadavg1"] = (load_average() or [None])[0]
        self._last_sample_t = now
        return s

    def print_sample(self, s: dict[str, Any]) -> None:
        def f(v: Any, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        print(
            f"t={s['t']:7.1f}s rss {f(s['rss_mib'], '.0f')} MiB kv {f(s['kv_cache_usage_pct'], '.1f')}% "
            f"run {f(s['running'], '.0f')} wait {f(s['waiting'], '.0f')} | done {s['completed']} "
            f"cancel {s['cancelled']} bad->4xx {s['malformed_4xx']} 5xx {s['server_error']} "
            f"lost {s['lost']} transport {s['transport_error']} | p99 e2e {f(s['p99_e2e_s'], '.2f')} s "
            f"ttft {f(s['p99_ttft_s'], '.2f')} s | {f(s['output_tok_s'], '.0f')} tok/s "
            f"(server {f(s['server_generation_tok_s'], '.0f')}) | CPU server {f(s['server_cpu_pct'], '.0f')}% "
            f"client {f(s['client_cpu_pct'], '.0f')}%"
            + (f" | scrape failed: {s['scrape_error']}" if s["scrape_error"] else ""),
            flush=True,
        )

    async def sweep(self) -> None:
        """Every malformed body once, one after another, before the load: a short run covers them all."""
        self.t0 = self._sweep_t0 = time.perf_counter()
        self.deadline = math.inf
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), headers=self.headers) as client:
            for name, endpoint, payload in self.malformed:
                rec = Record("malformed", name, time.perf_counter() - self.t0)
                try:
                    await asyncio.wait_for(
                        malformed_request(client, self.base_url + endpoint, payload, rec), self.args.request_timeout
                    )
                except asyncio.TimeoutError:
                    rec.outcome = "lost"
                    rec.error = f"malformed request still open after {self.args.request_timeout:g} s"
                except httpx.TransportError as e:
                    rec.outcome, rec.error = "transport_error", f"{type(e).__name__}: {e}"
                rec.end = time.perf_counter() - self.t0
                self.records.append(rec)
        odd = [f"{r.variant} {r.status or r.outcome}" for r in self.records if r.outcome != "malformed_4xx"]
        print(
            f"malformed sweep: {len(self.records) - len(odd)} of {len(self.records)} bodies answered 4xx"
            + (f"; not 4xx: {', '.join(odd)}" if odd else ""),
            flush=True,
        )

    async def run(self) -> float:
        """Drive the server for --duration s; returns the seconds the in-flight requests took to end after it."""
        a = self.args
        if a.malformed_sweep:
            await self.sweep()
        async with httpx.AsyncClient(timeout=30.0) as scraper:
            self.t0 = time.perf_counter()
            self.deadline = self.t0 + a.duration
            for rec in self.records:  # the sweep's: before the load, so negative times
                rec.start -= self.t0 - self._sweep_t0
                rec.end -= self.t0 - self._sweep_t0
            self.samples.append(await self.sample(scraper, "start"))  # the baseline: counters, idle memory, sweep
            clients = (
                asyncio.ensure_future(self.start_workers())
                if a.client_processes > 1
                else asyncio.gather(*(self.client_loop(i) for i in range(a.concurrency)))
            )
            for k in itertools.count(1):
                wake = self.t0 + k * a.scrape_interval
                if wake > self.deadline:
                    break
                await asyncio.sleep(max(0.0, wake - time.perf_counter()))
                s = await self.sample(scraper, "load")
                self.samples.append(s)
                self.print_sample(s)
            await clients
            drain_s = time.perf_counter() - self.deadline
            s = await self.sample(scraper, "drain")
            self.samples.append(s)
            self.print_sample(s)
        return drain_s


def _client_worker(
    args: argparse.Namespace,
    base_url: str,
    model: str,
    chat_fraction: float,
    malformed: list[tuple[str, str, bytes]],
    clients: list[int],
    index: int,
    t0: float,
    deadline: float,
    queue: Any,
    in_flight: Any,
) -> None:
    """One client process: its share of the client loops; finished records go to `queue` each second."""
    load = Load(args, base_url, model, chat_fraction > 0, 0, malformed)  # the same chat fraction as the parent's
    load.next_malformed = itertools.count(index * len(malformed) // args.client_processes)
    load.t0, load.deadline = t0, deadline

    async def main() -> None:
        loops = asyncio.gather(*(load.client_loop(i) for i in clients))
        sent = 0
        while not loops.done():
            await asyncio.wait([loops], timeout=1.0)
            in_flight[index] = load.in_flight
            queue.put(load.records[sent:])
            sent = len(load.records)
        await loops

    asyncio.run(main())
    queue.put(None)


# ---- after the load --------------------------------------------------------------------------------


async def settle(load: Load, timeout: float) -> dict[str, Any]:
    """Poll /metrics until nothing runs, waits or holds KV blocks (or `timeout` s pass)."""
    start = time.perf_counter()
    last: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=10.0, headers=load.headers) as client:
        while True:
            try:
                m = await load.scrape(client)
                last = {
                    "running": m.get("ember:num_requests_running"),
                    "waiting": m.get("ember:num_requests_waiting"),
                    "kv_cache_usage_pct": None
                    if m.get("ember:kv_cache_usage_perc") is None
                    else round(100 * m["ember:kv_cache_usage_perc"], 3),
                }
                idle = last["running"] == 0 and last["waiting"] == 0 and last["kv_cache_usage_pct"] == 0
            except Exception as e:  # noqa: BLE001
                last, idle = {"scrape_error": f"{type(e).__name__}: {e}"}, False
            waited = time.perf_counter() - start
            if idle or waited > timeout:
                break
            await asyncio.sleep(0.5)
        try:
            health = (await client.get(load.base_url + "/health")).status_code
        except Exception as e:  # noqa: BLE001
            health = f"{type(e).__name__}: {e}"
    return {
        **last,
        "idle": idle,
        "settle_s": round(waited, 2),
        "health": health,
        **{k: v for k, v in load.server_memory().items() if k != "pids"},
    }


def stop_server(proc: subprocess.Popen, tree: list[int], wait: float) -> dict[str, Any]:
    """SIGTERM the front end; time its exit and check that no process of its tree outlives it."""
    start = time.perf_counter()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    killed = False
    try:
        proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:  # it did not stop by itself: end its whole process group
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = True
    exit_s = time.perf_counter() - start
    survivors: list[int] = []
    deadline = time.perf_counter() + 5.0
    while True:
        survivors = [pid for pid in tree if pid != proc.pid and _alive(pid)]
        if not survivors or time.perf_counter() > deadline:
            break
        time.sleep(0.05)
    tree_exit_s = time.perf_counter() - start
    if survivors:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {
        "exit_code": proc.returncode,
        "exit_s": round(exit_s, 3),
        "tree_exit_s": round(tree_exit_s, 3),
        "killed": killed,
        "leftover_processes": survivors,
    }


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes, from /proc/<pid>/stat."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
        except (OSError, IndexError, ValueError):
            pass
    return total / _CLK_TCK


def _alive(pid: int) -> bool:
    if psutil is not None:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---- the verdict -----------------------------------------------------------------------------------


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _change(first: float | None, last: float | None) -> float | None:
    return None if first is None or last is None or first == 0 else last / first - 1


def summarize(
    args: argparse.Namespace, load: Load, device: str, after: dict[str, Any], shutdown: dict[str, Any], drain_s: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    records, samples = load.records, [s for s in load.samples if s["phase"] == "load"]
    counts = collections.Counter(r.outcome for r in records)
    by_kind = collections.Counter(r.kind for r in records)
    warmup = args.warmup if args.warmup is not None else 0.1 * args.duration
    # On CPU the KV cache is an anonymous memory map whose pages become resident as blocks are first
    # written, and the free queue hands out least recently used blocks first: RSS climbs until every
    # block has been used, by design. RSS is compared only once the tokens through the engine reach
    # KV_POOL_PASSES times the pool's (a request's last block is partly written; a second pass fills
    # in nearly all of those), so that the check finds leaks, not the pool filling in.
    rss_warmup, rss_note = warmup, None
    if device == "cpu" and load.kv_pool_tokens:
        cycled = next((s["t"] for s in samples if (s.get("kv_pool_passes") or 0) >= KV_POOL_PASSES), None)
        if cycled is None:
            rss_warmup = args.duration
            rss_note = (
                f"the engine did not write {KV_POOL_PASSES}x its KV pool ({load.kv_pool_tokens} tokens) "
                f"during the load, so RSS still grew with the pool: no RSS check; run longer, or give "
                f"the server a smaller --kv-cache-memory"
            )
        elif cycled > warmup:
            rss_warmup = cycled
            rss_note = (
                f"RSS warm-up extended to {cycled:g} s, when the engine had written {KV_POOL_PASSES}x its KV pool"
            )
    first, last, in_first, in_last, enough = _windows(samples, warmup, args.duration)
    rss_first_w, rss_last_w, rss_in_first, rss_in_last, rss_enough = _windows(samples, rss_warmup, args.duration)

    def p99(window: tuple[float, float]) -> float | None:
        values = sorted(r.e2e for r in records if r.outcome == "completed" and window[0] <= r.end <= window[1])
        return percentile(values, 99) if values else None

    def tok_s(window: list[dict[str, Any]]) -> float | None:
        key = (
            "server_generation_tokens"
            if all(s.get("server_generation_tokens") is not None for s in window)
            else "output_tokens"
        )
        seconds = sum(s["dt"] for s in window)
        return sum(s[key] for s in window) / seconds if window and seconds > 0 else None

    rss_first, rss_last = (
        (_mean([s["rss_mib"] for s in rss_in_first]), _mean([s["rss_mib"] for s in rss_in_last]))
        if rss_enough
        else (None, None)
    )
    p99_first, p99_last = p99(first), p99((last[0], args.duration + args.request_timeout))
    tput_first, tput_last = tok_s(in_first), tok_s(in_last)
    done = sorted(r.e2e for r in records if r.outcome == "completed")
    ttfts = sorted(r.ttft for r in records if r.outcome == "completed" and r.ttft is not None)
    errors = collections.Counter(r.error for r in records if r.error and r.outcome not in ("cancelled",))
    malformed: dict[str, dict[str, int]] = {}
    for r in records:
        if r.kind == "malformed":
            key = str(r.status) if r.status is not None else r.outcome
            malformed.setdefault(r.variant, collections.Counter())[key] += 1
    summary = {
        "requests": len(records),
        "by_kind": dict(by_kind),
        **{k: counts.get(k, 0) for k in OUTCOMES},
        "warmup_s": round(warmup, 1),
        "first_window_s": [round(first[0], 1), round(first[1], 1)],
        "last_window_s": [round(last[0], 1), args.duration],
        "rss_warmup_s": round(rss_warmup, 1),
        "rss_note": rss_note,
        "rss_first_window_s": [round(rss_first_w[0], 1), round(rss_first_w[1], 1)],
        "rss_last_window_s": [round(rss_last_w[0], 1), args.duration],
        "kv_pool_tokens": load.kv_pool_tokens,
        "kv_pool_passes": max((s.get("kv_pool_passes") or 0 for s in load.samples), default=None),
        "rss_mib_first": _round(rss_first, 1),
        "rss_mib_last": _round(rss_last, 1),
        "rss_growth": _round(_change(rss_first, rss_last), 4),
        "rss_mib_max": max((s["rss_mib"] for s in samples if s["rss_mib"] is not None), default=None),
        "p99_e2e_s_first": _round(p99_first, 3),
        "p99_e2e_s_last": _round(p99_last, 3),
        "p99_e2e_change": _round(_change(p99_first, p99_last), 4),
        "output_tok_s_first": _round(tput_first, 1),
        "output_tok_s_last": _round(tput_last, 1),
        "output_tok_s_change": _round(_change(tput_first, tput_last), 4),
        "p50_e2e_s": _round(percentile(done, 50), 3) if done else None,
        "p99_e2e_s": _round(percentile(done, 99), 3) if done else None,
        "p50_ttft_s": _round(percentile(ttfts, 50), 3) if ttfts else None,
        "p99_ttft_s": _round(percentile(ttfts, 99), 3) if ttfts else None,
        "output_tokens": sum(r.output_tokens for r in records if r.outcome == "completed"),
        "output_tok_s": _round(sum(r.output_tokens for r in records if r.outcome == "completed") / args.duration, 1),
        "server_cpu_pct_mean": _round(_mean([s.get("server_cpu_pct") for s in samples]), 1),
        "client_cpu_pct_mean": _round(_mean([s.get("client_cpu_pct") for s in samples]), 1),
        "preemptions": sum(s.get("server_num_preemptions") or 0 for s in load.samples),
        "loadavg_end": load_average(),
        "drain_s": round(drain_s, 2),
        "after_load": after,
        "shutdown": shutdown,
        "malformed_by_variant": {k: dict(v) for k, v in sorted(malformed.items())},
        "errors": [{"message": m, "count": c} for m, c in errors.most_common(ERRORS_KEPT)],
    }
    gpu = device.startswith("cuda")
    checks = [
        _check(
            "RSS growth after warm-up",
            summary["rss_growth"],
            f"<= {args.max_rss_growth:.0%}",
            None if not rss_enough or summary["rss_growth"] is None else summary["rss_growth"] <= args.max_rss_growth,
            pct=True,
        ),
        _check("lost requests", counts.get("lost", 0), "0", counts.get("lost", 0) == 0),
        _check("transport errors", counts.get("transport_error", 0), "0", counts.get("transport_error", 0) == 0),
        _check("5xx (HTTP or error event)", counts.get("server_error", 0), "0", counts.get("server_error", 0) == 0),
        _check(
            "malformed answered 2xx", counts.get("malformed_accepted", 0), "0", counts.get("malformed_accepted", 0) == 0
        ),
        _check("4xx to a valid request", counts.get("unexpected_4xx", 0), "0", counts.get("unexpected_4xx", 0) == 0),
        _check(
            "p99 E2E latency change",
            summary["p99_e2e_change"],
            f"<= +{args.max_p99_growth:.0%}",
            None
            if not enough or summary["p99_e2e_change"] is None
            else summary["p99_e2e_change"] <= args.max_p99_growth,
            pct=True,
        ),
        _check(
            "output tok/s change" + ("" if gpu or args.check_throughput else " (GPU only)"),
            summary["output_tok_s_change"],
            f">= -{args.max_throughput_drop:.0%}",
            None
            if not (gpu or args.check_throughput) or not enough or summary["output_tok_s_change"] is None
            else summary["output_tok_s_change"] >= -args.max_throughput_drop,
            pct=True,
        ),
        _check("live requests after load", _live(after), "0", _live(after) == 0 if _live(after) is not None else False),
        _check(
            "KV cache usage after load (%)", after.get("kv_cache_usage_pct"), "0", after.get("kv_cache_usage_pct") == 0
        ),
        _check("/health after load", after.get("health"), "200", after.get("health") == 200),
        _check(
            "exit after SIGTERM, idle (s)",
            shutdown["exit_s"],
            f"< {args.max_exit_s:g}",
            shutdown["exit_s"] < args.max_exit_s and not shutdown["killed"],
        ),
        _check(
            "exit code / leftover processes",
            f"{shutdown['exit_code']} / {len(shutdown['leftover_processes'])}",
            "0 / 0",
            shutdown["exit_code"] == 0 and not shutdown["leftover_processes"],
        ),
    ]
    return summary, checks


def _windows(
    samples: list[dict[str, Any]], warmup: float, duration: float
) -> tuple[tuple[float, float], tuple[float, float], list[dict[str, Any]], list[dict[str, Any]], bool]:
    """The first and last thirds of the load after `warmup`, by time, and the samples in each (a sample
    covers the interval before it); `enough` when each holds a sample and they differ."""
    span = duration - warmup
    first = (warmup, warmup + span / 3)
    last = (duration - span / 3, math.inf)
    in_first = [s for s in samples if first[0] <= s["t"] <= first[1]]
    in_last = [s for s in samples if s["t"] >= last[0]]
    enough = span > 0 and bool(in_first) and bool(in_last) and in_first[-1]["t"] < in_last[0]["t"]
    return first, last, in_first, in_last, enough


def _live(after: dict[str, Any]) -> float | None:
    if after.get("running") is None or after.get("waiting") is None:
        return None
    return after["running"] + after["waiting"]


def _round(v: float | None, digits: int) -> float | None:
    return None if v is None else round(v, digits)


def _check(name: str, value: Any, target: str, ok: bool | None, pct: bool = False) -> dict[str, Any]:
    shown = "-" if value is None else (f"{value:+.1%}" if pct and isinstance(value, (int, float)) else str(value))
    return {
        "check": name,
        "value": value,
        "shown": shown,
        "target": target,
        "result": "n/a" if ok is None else ("pass" if ok else "FAIL"),
    }


def print_report(summary: dict[str, Any], checks: list[dict[str, Any]]) -> None:
    s = summary
    print(
        f"\n{s['requests']} requests ({', '.join(f'{k} {v}' for k, v in s['by_kind'].items())}): "
        + ", ".join(f"{k} {s[k]}" for k in OUTCOMES)
    )
    print(
        f"p50 / p99 E2E {s['p50_e2e_s']} / {s['p99_e2e_s']} s, TTFT {s['p50_ttft_s']} / {s['p99_ttft_s']} s, "
        f"{s['output_tok_s']} output tok/s (completed requests); drain {s['drain_s']} s"
    )
    print(
        f"CPU (100% = one core): server {s['server_cpu_pct_mean']}%, this client {s['client_cpu_pct_mean']}%; "
        f"load average at the end {s['loadavg_end']}; {s['preemptions']} preemptions"
    )
    if s["rss_note"]:
        print(s["rss_note"])
    print(
        f"after warm-up ({s['warmup_s']} s): RSS {s['rss_mib_first']} -> {s['rss_mib_last']} MiB, p99 E2E "
        f"{s['p99_e2e_s_first']} -> {s['p99_e2e_s_last']} s, tok/s {s['output_tok_s_first']} -> "
        f"{s['output_tok_s_last']} (first third {s['first_window_s']} s vs last third {s['last_window_s']} s; "
        f"RSS: {s['rss_first_window_s']} vs {s['rss_last_window_s']} s)"
    )
    bad = {k: v for k, v in s["malformed_by_variant"].items() if any(not c.startswith("4") for c in v)}
    if bad:
        print("malformed bodies not answered 4xx: " + "; ".join(f"{k} {v}" for k, v in bad.items()))
    for e in s["errors"][:8]:
        print(f"  {e['count']:5d} x {e['message'][:160]}")
    width = max(len(c["check"]) for c in checks) + 2
    print(f"\n{'check':<{width}}{'measured':>16}{'target':>12}  result")
    for c in checks:
        print(f"{c['check']:<{width}}{c['shown']:>16}{c['target']:>12}  {c['result']}")


def write_chart(
    path: str,
    samples: list[dict[str, Any]],
    title: str,
    warmup_s: float,
    duration_s: float,
    rss_warmup_s: float | None = None,
) -> None:
    """RSS, KV usage, live requests, p99 latency and throughput over time. Optional: without matplotlib, no chart."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] / 60 for s in samples]

    def series(key: str) -> list[float]:
        return [math.nan if s.get(key) is None else s[key] for s in samples]

    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    axes[0].plot(t, series("rss_mib"), ".-", label="process tree")
    axes[0].plot(t, series("rss_mib_front_end"), ".-", label="front end")
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].plot(t, series("kv_cache_usage_pct"), ".-")
    axes[1].set_ylabel("KV cache usage (%)")
    axes[2].plot(t, series("running"), ".-", label="running")
    axes[2].plot(t, series("waiting"), ".-", label="waiting")
    axes[2].plot(t, series("client_in_flight"), ":", label="client in flight")
    axes[2].set_ylabel("live requests")
    axes[3].plot(t, series("p99_e2e_s"), ".-", label="p99 E2E")
    axes[3].plot(t, series("p99_ttft_s"), ".-", label="p99 TTFT")
    axes[3].set_ylabel("latency (s), per interval")
    tput = axes[3].twinx()
    tput.plot(t, series("server_generation_tok_s"), ".-", color="gray", alpha=0.6, label="output tok/s (server)")
    tput.set_ylabel("output tok/s")
    tput.legend(fontsize=7, loc="lower right")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.axvline(warmup_s / 60, color="black", linewidth=0.8, linestyle="--")  # the checks start here
        ax.axvline(duration_s / 60, color="black", linewidth=0.8)  # the load stops here
        if any(not line.get_label().startswith("_") for line in ax.get_lines()):
            ax.legend(fontsize=7, loc="upper left")
    if rss_warmup_s is not None and rss_warmup_s != warmup_s:  # where the RSS windows start
        axes[0].axvline(rss_warmup_s / 60, color="black", linewidth=0.8, linestyle=":")
    axes[3].set_ylim(bottom=0)
    tput.set_ylim(bottom=0)
    axes[-1].set_xlabel("minutes")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main ------------------------------------------------------------------------------------------


async def probe(base_url: str, headers: dict[str, str], timeout: float) -> tuple[str, int | None, bool, str | None]:
    """The served model id and context length (GET /v1/models), and whether chat works: a model loaded
    without a tokenizer (a random-weight config) answers chat with 400, and then the soak sends none. A
    chat probe that fails otherwise (5xx, timeout) leaves chat on: the soak is there to count that."""
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
        resp = await client.get(base_url + "/v1/models")
        resp.raise_for_status()
        card = resp.json()["data"][0]
        model = card["id"]
        try:
            chat = await client.post(
                base_url + CHAT, json={"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
            )
        except httpx.HTTPError as e:
            return model, card.get("max_model_len"), True, f"chat probe failed: {type(e).__name__}: {e}"
        if chat.status_code == 200:
            return model, card.get("max_model_len"), True, None
        note = f"chat probe answered {chat.status_code}: {error_message(chat.content)}"
        return model, card.get("max_model_len"), not 400 <= chat.status_code < 500, note


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _body_limit(extra: list[str]) -> int:
    for i, arg in enumerate(extra):
        if arg.startswith("--max-request-body-bytes"):
            value = arg.split("=", 1)[1] if "=" in arg else (extra[i + 1] if i + 1 < len(extra) else "")
            if value.isdigit():
                return int(value)
    return 1 << 20


def _range(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p, argv, extra = server_benchmark_parser(argv, __doc__)
    p.add_argument("--duration", type=float, default=1200.0, help="seconds of load (default: 20 minutes)")
    p.add_argument("--concurrency", type=_range, default=32, help="closed-loop clients, one connection each")
    p.add_argument(
        "--cancel-fraction",
        type=float,
        default=0.10,
        help="well-formed requests whose client closes the connection mid-stream",
    )
    p.add_argument("--malformed-fraction", type=float, default=0.05, help="requests with a bad body (expect 4xx)")
    p.add_argument(
        "--chat-fraction",
        type=float,
        default=0.5,
        help="well-formed requests to /v1/chat/completions, the rest to /v1/completions (token ids); "
        "0 when the model has no tokenizer",
    )
    p.add_argument(
        "--prompt-len",
        type=_range,
        nargs=2,
        default=[8, 256],
        metavar=("MIN", "MAX"),
        help="prompt length: token ids for completions, words for chat",
    )
    p.add_argument("--max-tokens", type=_range, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: ignore_eos, so each generates its max_tokens)",
    )
    p.add_argument("--vocab-size", type=int, default=10000, help="completion prompt ids are drawn from [100, this)")
    p.add_argument(
        "--no-malformed-sweep",
        dest="malformed_sweep",
        action="store_false",
        help="skip sending every malformed body once before the load",
    )
    p.add_argument("--scrape-interval", type=float, default=10.0, help="seconds between /metrics scrapes")
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds excluded from the flatness checks (default: 10%% of --duration)",
    )
    p.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds after which an open request counts as lost"
    )
    p.add_argument(
        "--client-processes",
        type=_range,
        default=1,
        help="processes that share the clients (one Python process tops out near 10k SSE chunks/s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds the server may take to start")
    p.add_argument(
        "--settle-timeout",
        type=float,
        default=15.0,
        help="seconds after the load for live requests and KV usage to reach 0",
    )
    p.add_argument("--shutdown-wait", type=float, default=30.0, help="seconds after SIGTERM before SIGKILL")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--max-p99-growth", type=float, default=0.20)
    p.add_argument("--max-throughput-drop", type=float, default=0.05)
    p.add_argument(
        "--check-throughput",
        action="store_true",
        help="check throughput flatness on CPU too (by default only on a GPU)",
    )
    p.add_argument("--max-exit-s", type=float, default=2.0, help="seconds an idle server may take to exit on SIGTERM")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/soak-<device>-<date>.json); a PNG chart goes "
        "next to it if matplotlib is installed",
    )
    args = p.parse_args(argv)
    for name in ("cancel_fraction", "malformed_fraction", "chat_fraction"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    if args.duration <= 0 or args.scrape_interval <= 0 or args.request_timeout <= 0:
        p.error("--duration, --scrape-interval and --request-timeout must be positive")
    for name in ("prompt_len", "max_tokens"):
        low, high = getattr(args, name)
        if low > high:
            p.error(f"--{name.replace('_', '-')}: MIN > MAX")
    if args.vocab_size <= TOKEN_ID_LOW:
        p.error(f"--vocab-size must be > {TOKEN_ID_LOW}")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    if httpx is None:
        print("benchmarks/soak.py needs httpx (pip install httpx)", file=sys.stderr)
        return 2
    # `timeout` or a job scheduler stops us with SIGTERM: unwind, so that the server is stopped too
    signal.signal(signal.SIGTERM, _interrupted)
    machine = machine_info()  # before the server starts: loadavg shows what else runs here
    port = free_port(args.host)
    base_url = f"http://{args.host}:{port}"
    cmd = server_command(args.model, args.host, port, extra)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    log = tempfile.NamedTemporaryFile("w+", encoding="utf-8", prefix="soak-server-", suffix=".log", delete=False)
    print(f"starting: {' '.join(cmd)} (log: {log.name})", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    shutdown = None
    try:
        try:
            ready_s = wait_ready(proc, args.host, port, start, args.ready_timeout)
        except RuntimeError as e:
            log.flush()
            log.seek(0)
            print(f"the server did not start: {e}\n" + "".join(log.readlines()[-30:]), file=sys.stderr)
            return 2
        log.flush()
        log.seek(0)
        ready_log = log.read()
        match = READY_LINE_DEVICE.search(ready_log)
        device = match.group(1) if match else "unknown"
        kv = _KV_POOL.search(ready_log)
        headers = {"Authorization": f"Bearer {os.environ['EMBER_API_KEY']}"} if os.environ.get("EMBER_API_KEY") else {}
        model, max_model_len, chat_ok, chat_note = asyncio.run(probe(base_url, headers, args.request_timeout))
        print(
            f"ready after {ready_s:.1f} s on {device}: model {model}, max_model_len {max_model_len}"
            + (f"; {chat_note}" if chat_note else "")
            + ("; no chat requests" if not chat_ok else ""),
            flush=True,
        )
        malformed = malformed_bodies(model, max_model_len, _body_limit(extra))
        load = Load(args, base_url, model, chat_ok, proc.pid, malformed)
        load.kv_pool_tokens = int(kv.group(1)) * int(kv.group(2)) if kv else None
        print(
            f"load: {args.duration:g} s, {args.concurrency} clients, {args.cancel_fraction:.0%} cancelled, "
            f"{args.malformed_fraction:.0%} malformed ({len(malformed)} kinds), scrape every "
            f"{args.scrape_interval:g} s",
            flush=True,
        )
        drain_s = asyncio.run(load.run())
        after = asyncio.run(settle(load, args.settle_timeout))
        print(f"after the load: {after}", flush=True)
        tree = process_tree(proc.pid)
        shutdown = stop_server(proc, tree, args.shutdown_wait)
        print(
            f"SIGTERM: exit code {shutdown['exit_code']} after {shutdown['exit_s']} s"
            + (", killed" if shutdown["killed"] else "")
            + (f", leftover {shutdown['leftover_processes']}" if shutdown["leftover_processes"] else ""),
            flush=True,
        )
    finally:
        if shutdown is None:
            stop_server(proc, process_tree(proc.pid) if proc.poll() is None else [], 10.0)
        log.flush()
        log.seek(0)
        log_text = log.read()
        log.close()
    os.unlink(log.name)

    summary, checks = summarize(args, load, device, after, shutdown, drain_s)
    summary["ready_s"] = round(ready_s, 2)
    summary["chat"] = ("on" if chat_ok else "off") + (f" ({chat_note})" if chat_note else "")
    print_report(summary, checks)
    out = args.out or os.path.join(RESULTS_DIR, f"soak-{device.split(':')[0]}-{today()}.json")
    lines = log_text.splitlines()
    write_json(
        out,
        {
            "benchmark": "soak",
            "date": today(),
            "machine": machine,
            "command": sys.argv,
            "config": {
                **vars(args),
                "server_args": extra,
                "server_command": cmd,
                "device": device,
                "model": model,
                "max_model_len": max_model_len,
                "kv_pool": {
                    "blocks": int(kv.group(1)),
                    "block_size": int(kv.group(2)),
                    "gib": None if kv.group(3) is None else float(kv.group(3)),
                }
                if kv
                else None,
                "malformed_variants": [name for name, _, _ in malformed],
            },
            "results": {
                "summary": summary,
                "checks": checks,
                "samples": load.samples,
                "server_log": {
                    "lines": len(lines),
                    "tracebacks": sum(line.startswith("Traceback") for line in lines),
                    "error_lines": sum(line.startswith("ERROR") for line in lines),
                    "tail": lines[-40:],
                },
            },
        },
    )
    png = os.path.splitext(out)[0] + ".png"
    write_chart(
        png,
        load.samples,
        f"soak: {model} on {device}, {args.concurrency} clients, {args.duration:g} s "
        f"({machine.get('ember_commit')})\ndashed: end of warm-up (dotted: of the RSS "
        f"check), solid: end of load",
        summary["warmup_s"],
        args.duration,
        summary["rss_warmup_s"],
    )
    print(f"wrote {out}" + (f" and {png}" if os.path.exists(png) else ""))
    return 0 if all(c["result"] != "FAIL" for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
