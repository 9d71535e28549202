"""`ember bench serve`: a serving benchmark client for any OpenAI-compatible server.

It sends `--num-prompts` streaming requests to a running server (Ember, vLLM, llama.cpp's server,
...) with Poisson arrivals at `--request-rate` (or all at once), optionally capped at
`--max-concurrency` requests in flight, and reports what a user of the server sees. The metric
names and definitions follow vLLM's `benchmark_serving`:

- TTFT: seconds from sending a request to the first chunk that carries output: text, or (as vLLM
  streams) a chunk for tokens whose text is not out yet (an unfinished character, a model served
  without a tokenizer); a chat stream's opening role-only chunk does not count;
- ITL: the gaps between consecutive such chunks (a chunk may hold several tokens);
- TPOT: (E2E - TTFT) / (output tokens - 1), per request, for requests with more than one token;
- E2E: seconds from sending a request to the end of its stream;
- request, input, output and total token throughput over the whole run (successful requests only).

Output token counts come from the stream's final `usage` chunk (`stream_options.include_usage`),
or, where a server sends none, from the number of chunks that carried output.

    ember serve &                                               # or any OpenAI-compatible server
    ember bench serve --num-prompts 200 --random-input-len 512 --random-output-len 128 --request-rate 8 \\
        --result-file serve.json

The HTTP client is a small HTTP/1.1 client over `asyncio.open_connection`, one connection per
request (`Connection: close`), with Content-Length, chunked and read-to-close bodies: Ember
declares no HTTP client library as a dependency, and this keeps `ember bench serve` usable with
nothing beyond Ember installed. The extra TCP handshake per request costs well under a millisecond
on a local or LAN connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import random
import ssl
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ember.bench.machine import basic_machine_info
from ember.bench.workloads import nano_vllm_requests

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ERRORS_KEPT = 5                   # distinct error messages kept in the result, in order of first sight
_ERROR_BODY_LIMIT = 64 * 1024     # bytes of an error response read for its message
_LINE_LIMIT = 16 * 1024 * 1024    # longest header or SSE line accepted
_MODELS_TIMEOUT_S = 30.0
# vLLM's random dataset draws prompt token ids from [100, 10000); --vocab-size clamps the top.
TOKEN_ID_LOW, TOKEN_ID_HIGH = 100, 10000
STATS = ("mean", "median", "std", "p90", "p99")
METRICS = (("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
           ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL"))

# Chat prompts are random words: a chat template needs text, and these tokenize to about one token
# each in the usual BPE vocabularies. Input token counts then come from the server's `usage`.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there one all we their been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while last might us "
    "great old year off come since against go came right used take three small river light water house city"
).split()


# ---- a small asyncio HTTP/1.1 client ------------------------------------------------------------


class ProtocolError(Exception):
    """The server's bytes do not make a valid HTTP response or event stream."""


class HTTPStatusError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class StreamError(Exception):
    """An error event inside a stream that had already answered 200."""


class Response:
    """Status and headers of one response, and its body, read once as bytes, or as server-sent events."""

    def __init__(self, status: int, headers: dict[str, str], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.status = status
        self.headers = headers
        self._reader = reader
        self._writer = writer

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        reader = self._reader
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readline()
                if not size_line.endswith(b"\n"):
                    raise ProtocolError("connection closed inside a chunked body")
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size line {size_line[:40]!r}") from None
                if size == 0:  # last chunk; skip any trailers up to the blank line
                    while (await reader.readline()).strip():
                        pass
                    return
                data = await reader.readexactly(size)
                if (await reader.readexactly(2)) != b"\r\n":
                    raise ProtocolError("chunk not followed by CRLF")
                yield data
        elif "content-length" in self.headers:
            try:
                remaining = int(self.headers["content-length"])
            except ValueError:
                raise ProtocolError(f"bad Content-Length {self.headers['content-length']!r}") from None
            while remaining > 0:
                data = await reader.read(min(remaining, 1 << 16))
                if not data:
                    raise ProtocolError(f"connection closed with {remaining} body bytes missing")
                remaining -= len(data)
                yield data
        else:  # HTTP/1.0 style: the body runs until the server closes the connection
            while data := await reader.read(1 << 16):
                yield data

    async def read(self, limit: int | None = None) -> bytes:
        body = bytearray()
        async for data in self.iter_bytes():
            body += data
            if limit is not None and len(body) >= limit:
                return bytes(body[:limit])
        return bytes(body)

    async def iter_sse(self) -> AsyncIterator[str]:
        """The `data` of each server-sent event (several `data:` lines of one event joined by newlines)."""
        buffer = b""
        data: list[str] = []
        async for chunk in self.iter_bytes():
            *lines, buffer = (buffer + chunk).split(b"\n")
            if len(buffer) > _LINE_LIMIT:
                raise ProtocolError("event stream line too long")
            for raw in lines:
                line = raw.rstrip(b"\r").decode("utf-8")
                if not line:
                    if data:
                        yield "\n".join(data)
                        data = []
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
                # comments (":...") and other fields (event:, id:, retry:) carry nothing we use
        tail = buffer.rstrip(b"\r").decode("utf-8")
        if tail.startswith("data:"):
            data.append(tail[5:].removeprefix(" "))
        if data:
            yield "\n".join(data)

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)


async def http_request(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None) -> Response:
    """Send one request (a JSON body if `body` is not None) on a new connection; returns once the headers are in."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    host = parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    context = ssl.create_default_context() if parts.scheme == "https" else None
    reader, writer = await asyncio.open_connection(host, port, ssl=context, limit=_LINE_LIMIT)
    try:
        host_header = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            host_header += f":{parts.port}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"{method} {target} HTTP/1.1", f"Host: {host_header}", "User-Agent: ember-bench",
                 "Accept: */*", "Connection: close"]
        payload = b""
        if body is not None:
            payload = json.dumps(body).encode("utf-8")
            lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload)
        await writer.drain()
        while True:
            status_line = await reader.readline()
            if not status_line:
                raise ProtocolError("connection closed before a response")
            fields = status_line.decode("latin-1").split(None, 2)
            if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
                raise ProtocolError(f"bad status line {status_line[:80]!r}")
            status = int(fields[1])
            response_headers: dict[str, str] = {}
            while True:
                line = await reader.readline()
                if not line.endswith(b"\n"):
                    raise ProtocolError("connection closed inside the response headers")
                line = line.rstrip(b"\r\n")
                if not line:
                    break
                name, sep, value = line.decode("latin-1").partition(":")
                if not sep:
                    raise ProtocolError(f"bad header line {line[:80]!r}")
                key = name.strip().lower()
                value = value.strip()
                response_headers[key] = f"{response_headers[key]}, {value}" if key in response_headers else value
            if status >= 200 or status == 101:  # 1xx interim responses (100 Continue, ...) precede the real one
                return Response(status, response_headers, reader, writer)
    except BaseException:
        writer.close()
        raise


def error_message(body: bytes) -> str:
    """The message of an error body: OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or the text itself."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:300] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail")
            if msg:
                return str(msg)[:300]
        elif isinstance(err, str):
            return err[:300]
    return text[:300]


async def get_json(url: str, headers: dict[str, str], timeout: float = _MODELS_TIMEOUT_S) -> Any:
    async def get() -> Any:
        resp = await http_request("GET", url, headers=headers)
        try:
            body = await resp.read(_LINE_LIMIT)
        finally:
            await resp.close()
        if resp.status != 200:
            raise HTTPStatusError(resp.status, error_message(body))
        return json.loads(body)

    return await asyncio.wait_for(get(), timeout)


# ---- workload -----------------------------------------------------------------------------------


@dataclass
class RequestSpec:
    prompt: list[int] | str
    prompt_len: int   # tokens for a token-id prompt; words for a chat prompt (the server's usage counts tokens)
    output_len: int   # max_tokens


def sample_lengths(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    """Uniform integers in [length * (1 - ratio), length * (1 + ratio)], at least 1."""
    low, high = max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def make_requests(args: argparse.Namespace) -> list[RequestSpec]:
    """Seeded: the same flags give the same prompts. Input lengths are drawn first, then output lengths."""
    if args.dataset == "nano-vllm":
        prompts, max_tokens = nano_vllm_requests(args.num_prompts, vocab_size=args.vocab_size)
        # Seed 0 is the workload exactly. Another run against the same server would find every prompt in its
        # prefix cache; shifting the ids by the seed keeps the lengths (the work) and makes the prompts new.
        prompts = [[(t + args.seed) % args.vocab_size for t in p] for p in prompts]
        return [RequestSpec(p, len(p), n) for p, n in zip(prompts, max_tokens)]
    rng = random.Random(args.seed)
    ratio = args.random_range_ratio if args.dataset == "random" else 0.0
    input_lens = sample_lengths(rng, args.num_prompts, args.random_input_len, ratio)
    output_lens = sample_lengths(rng, args.num_prompts, args.random_output_len, ratio)
    high = min(TOKEN_ID_HIGH, args.vocab_size)
    low = TOKEN_ID_LOW if high > TOKEN_ID_LOW else 0
    specs = []
    for n_in, n_out in zip(input_lens, output_lens):
        if args.endpoint == CHAT:
            prompt: list[int] | str = " ".join(rng.choice(_WORDS) for _ in range(n_in))
        else:
            prompt = [rng.randrange(low, high) for _ in range(n_in)]
        specs.append(RequestSpec(prompt, n_in, n_out))
    return specs


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process (exponential gaps), or all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)  # its own stream: the arrivals do not depend on the prompts drawn
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def request_body(args: argparse.Namespace, model: str, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "temperature": args.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if args.endpoint == CHAT:
        # Both names: newer servers read max_completion_tokens, older ones (and llama.cpp) max_tokens.
        body.update(messages=[{"role": "user", "content": spec.prompt}], max_completion_tokens=spec.output_len,
                    max_tokens=spec.output_len)
    else:
        body.update(prompt=spec.prompt, max_tokens=spec.output_len)
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(args.extra_body or {})
    return body


# ---- one request ----------------------------------------------------------------------------------


@dataclass
class RequestResult:
    prompt_len: int
    max_tokens: int
    success: bool = False
    error: str | None = None
    start_s: float = 0.0                 # when it was sent, seconds after the benchmark started
    ttft: float | None = None            # seconds
    e2e: float | None = None             # seconds
    itl: list[float] = field(default_factory=list)
    text_chunks: int = 0
    prompt_tokens: int | None = None     # from the server's usage
    output_tokens: int | None = None     # from the server's usage, else text_chunks

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len


def _carries_output(choice: dict[str, Any], chat: bool) -> bool:
    """Text, or a progress chunk: one sent before the finish for tokens whose text is not out yet."""
    if not chat:
        return bool(choice.get("text")) or choice.get("finish_reason") is None
    delta = choice.get("delta") or {}
    # reasoning models stream their thinking in a field of its own; it is output all the same
    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    return bool(text) or (choice.get("finish_reason") is None and not delta.get("role"))


async def _stream_one(url: str, body: dict[str, Any], headers: dict[str, str], chat: bool,
                      res: RequestResult, start: float) -> None:
    resp = await http_request("POST", url, body, headers)
    try:
        if resp.status != 200:
            raise HTTPStatusError(resp.status, error_message(await resp.read(_ERROR_BODY_LIMIT)))
        done = finished = False
        last = start
        async with contextlib.aclosing(resp.iter_sse()) as events:
            async for data in events:
                now = time.perf_counter()
                if data.strip() == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ProtocolError(f"unexpected event {data[:100]!r}")
                if chunk.get("error"):
                    raise StreamError(f"error event in the stream: {error_message(data.encode('utf-8'))}")
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
                    res.output_tokens = usage.get("completion_tokens", res.output_tokens)
                for choice in chunk.get("choices") or ():
                    if _carries_output(choice, chat):
                        if res.ttft is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.text_chunks += 1
                    if choice.get("finish_reason") is not None:
                        finished = True
                        if res.ttft is None:  # every token decoded to nothing (e.g. skipped special tokens)
                            res.ttft = now - start
        res.e2e = time.perf_counter() - start
    finally:
        await resp.close()
    if not (done or finished):
        raise ProtocolError("stream ended without a finish_reason or [DONE]")
    if res.ttft is None:
        raise ProtocolError("stream ended without any output")
    if res.output_tokens is None:
        res.output_tokens = res.text_chunks
    res.success = True


class InFlight:
    def __init__(self) -> None:
        self.now = self.max = 0

    @contextlib.contextmanager
    def track(self) -> Any:
        self.now += 1
        self.max = max(self.max, self.now)
        try:
            yield
        finally:
            self.now -= 1


async def send_request(url: str, body: dict[str, Any], headers: dict[str, str], chat: bool, spec: RequestSpec,
                       timeout: float, t0: float, in_flight: InFlight) -> RequestResult:
    """Never raises for a failed request: the failure is recorded in the result."""
    res = RequestResult(spec.prompt_len, spec.output_len)
    start = time.perf_counter()
    res.start_s = start - t0
    with in_flight.track():
        try:
            await asyncio.wait_for(_stream_one(url, body, headers, chat, res, start), timeout)
        except asyncio.TimeoutError:  # before OSError: it is one since Python 3.11
            res.error = f"timed out after {timeout:g} s"
        except (HTTPStatusError, StreamError) as e:
            res.error = str(e)
        except Exception as e:  # noqa: BLE001 - refused or dropped connections, bad bytes, odd JSON: one failure each
            res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if res.error is not None:
        res.success = False
    return res


# ---- the run --------------------------------------------------------------------------------------


async def run_requests(args: argparse.Namespace, model: str, specs: Sequence[RequestSpec],
                       headers: dict[str, str]) -> tuple[list[RequestResult], float, int]:
    """All requests at their arrival times; returns the results, the duration and the most requests in flight."""
    url = args.base_url.rstrip("/") + args.endpoint
    chat = args.endpoint == CHAT
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    in_flight = InFlight()
    progress = _progress(len(specs), args.disable_tqdm)

    async def one(spec: RequestSpec) -> RequestResult:
        body = request_body(args, model, spec)
        async with limit if limit is not None else contextlib.nullcontext():
            res = await send_request(url, body, headers, chat, spec, args.request_timeout, t0, in_flight)
        if progress is not None:
            progress.update(1)
        return res

    times = arrival_times(len(specs), args.request_rate, args.seed)
    tasks = []
    t0 = time.perf_counter()
    try:
        for spec, at in zip(specs, times):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec)))
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        if progress is not None:
            progress.close()
    return list(results), time.perf_counter() - t0, in_flight.max


def _progress(total: int, disable: bool) -> Any:
    if disable or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks, as numpy.percentile does by default."""
    k = (len(sorted_values) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std, p90, p99 in milliseconds; None for each when there are no values."""
    if not values_s:
        return dict.fromkeys(STATS)
    ms = sorted(v * 1e3 for v in values_s)
    mean = sum(ms) / len(ms)
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))
    return {"mean": round(mean, 3), "median": round(percentile(ms, 50), 3), "std": round(std, 3),
            "p90": round(percentile(ms, 90), 3), "p99": round(percentile(ms, 99), 3)}


def summarize(results: Sequence[RequestResult], duration: float, max_in_flight: int) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    seconds = max(duration, 1e-9)
    errors = Counter(r.error for r in results if not r.success)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": round(duration, 6),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": round(len(ok) / seconds, 4),
        "input_throughput": round(input_tokens / seconds, 3),
        "output_throughput": round(output_tokens / seconds, 3),
        "total_token_throughput": round((input_tokens + output_tokens) / seconds, 3),
        "max_concurrency_observed": max_in_flight,
    }
    per_metric = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2e for r in ok],
    }
    for name, values in per_metric.items():
        for stat, value in distribution(values).items():
            summary[f"{stat}_{name}_ms"] = value
    summary["failures_by_kind"] = dict(Counter(_error_kind(r.error) for r in results if not r.success))
    summary["errors"] = [{"message": msg, "count": n} for msg, n in list(errors.items())[:ERRORS_KEPT]]
    return summary


def _error_kind(error: str | None) -> str:
    """'HTTP 400', 'timeout', or the exception's name: failures grouped whatever their message's details."""
    if error is None:
        return "unknown"
    if error.startswith("timed out"):
        return "timeout"
    return error.split(":", 1)[0]


def request_records(results: Sequence[RequestResult], detailed: bool) -> list[dict[str, Any]]:
    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 3)

    records = []
    for r in results:
        rec = {"success": r.success, "error": r.error, "start_s": round(r.start_s, 4),
               "prompt_tokens": r.input_tokens, "max_tokens": r.max_tokens, "output_tokens": r.output_tokens,
               "ttft_ms": ms(r.ttft), "tpot_ms": ms(r.tpot), "e2el_ms": ms(r.e2e)}
        if detailed:
            rec["itl_ms"] = [ms(v) for v in r.itl]
        records.append(rec)
    return records


def print_report(summary: dict[str, Any], label: str | None) -> None:
    width = 50

    def row(name: str, value: Any, fmt: str = "") -> None:
        text = "n/a" if value is None else format(value, fmt)
        print(f"{name:<40}{text:>10}")

    print(f" Serving Benchmark Result{f' ({label})' if label else ''} ".center(width, "="))
    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Maximum concurrency observed:", summary["max_concurrency_observed"])
    row("Benchmark duration (s):", summary["duration_s"], ".2f")
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"], ".2f")
    row("Input token throughput (tok/s):", summary["input_throughput"], ".2f")
    row("Output token throughput (tok/s):", summary["output_throughput"], ".2f")
    row("Total token throughput (tok/s):", summary["total_token_throughput"], ".2f")
    for key, title, short in METRICS:
        print(f" {title} ".center(width, "-"))
        for stat in STATS:
            name = {"mean": "Mean", "median": "Median", "std": "Std", "p90": "P90", "p99": "P99"}[stat]
            row(f"{name} {short} (ms):", summary[f"{stat}_{key}_ms"], ".2f")
    if summary["errors"]:
        print(" Failures ".center(width, "-"))
        for kind, n in summary["failures_by_kind"].items():
            row(f"{kind}:", n)
        print("first distinct messages:")
        for e in summary["errors"]:
            print(f"{e['count']:>5} x {e['message']}")
    print("=" * width)


# ---- machine and code -----------------------------------------------------------------------------


def client_machine_info() -> dict[str, Any]:
    """The machine the client ran on (often the server's too); no torch import needed."""
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {**basic_machine_info(), "torch": version("torch"), "ember": version("ember")}


def _raise_open_files_limit(needed: int) -> None:
    """One connection per request in flight: lift the soft descriptor limit towards the hard one if needed."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):
        pass


# ---- command line -----------------------------------------------------------------------------------


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive or inf, got {text}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


class _Flags:
    """An argument group that leaves out the flags named in `omit`."""

    def __init__(self, p: argparse.ArgumentParser, title: str, omit: Collection[str]) -> None:
        self.group = p.add_argument_group(title)
        self.omit = omit

    def add_argument(self, *flags: str, **kwargs: Any) -> None:
        if flags[0] not in self.omit:
            self.group.add_argument(*flags, **kwargs)


def add_serve_bench_args(p: argparse.ArgumentParser, omit: Collection[str] = ()) -> None:
    """`ember bench serve`'s flags. A script that calls `benchmark` itself names in `omit` (by first name) the flags
    it sets on its own (benchmarks/serve_sweep.py sets --request-rate per run), so that its users are not offered
    them."""
    g = _Flags(p, "server", omit)
    g.add_argument("--base-url", default=DEFAULT_BASE_URL, help="the server's root URL (default: %(default)s)")
    g.add_argument("--endpoint", default=COMPLETIONS, choices=(COMPLETIONS, CHAT),
                   help="completions send token-id prompts; chat sends random words (default: %(default)s)")
    g.add_argument("--model", default=None, help="model name sent in requests (default: the first id of /v1/models)")
    g.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' (default: $EMBER_API_KEY, as `ember serve` reads it)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take, connection to last byte, before it counts as failed")
    g = _Flags(p, "load", omit)
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf, every request at once)")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    g = _Flags(p, "dataset", omit)
    g.add_argument("--dataset", choices=("random", "fixed", "nano-vllm"), default="random",
                   help="random: lengths uniform in [len*(1-r), len*(1+r)]; fixed: exactly the given lengths; "
                        "nano-vllm: the offline benchmark's requests (benchmarks/throughput.py), token ids")
    g.add_argument("--random-input-len", "--input-len", dest="random_input_len", type=int, default=1024,
                   help="prompt tokens (words for chat)")
    g.add_argument("--random-output-len", "--output-len", dest="random_output_len", type=int, default=128,
                   help="max_tokens of each request")
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="r above, in [0, 1) (random dataset only)")
    g.add_argument("--vocab-size", type=int, default=TOKEN_ID_HIGH,
                   help="prompt token ids are drawn from [100, min(10000, this)); set it below a smaller vocabulary")
    g.add_argument("--seed", type=int, default=0,
                   help="draws the random and fixed prompts; nano-vllm: 0 sends its prompts exactly, another seed "
                        "shifts every token id by it (the same lengths, prompts a prefix cache has not seen)")
    g = _Flags(p, "sampling", omit)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos: true so each request generates exactly its max_tokens (Ember, vLLM)")
    g.add_argument("--extra-body", type=_json_object, default=None,
                   help="JSON object merged into every request body, e.g. '{\"top_k\": 20}'")
    g = _Flags(p, "output", omit)
    g.add_argument("--result-file", default=None, help="write the results as JSON here")
    g.add_argument("--label", default=None, help="a name for this run, kept in the results")
    g.add_argument("--save-detailed", action="store_true", help="also keep every request's inter-token gaps")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar (there is none when not on a tty)")


def check_args(args: argparse.Namespace) -> None:
    problems = [
        (args.num_prompts < 1, "--num-prompts must be >= 1"),
        (args.max_concurrency is not None and args.max_concurrency < 1, "--max-concurrency must be >= 1"),
        (args.random_input_len < 1 or args.random_output_len < 1, "input and output lengths must be >= 1"),
        (not 0 <= args.random_range_ratio < 1, "--random-range-ratio must be in [0, 1)"),
        (args.vocab_size < 2, "--vocab-size must be >= 2"),
        (not args.request_timeout > 0, "--request-timeout must be positive"),
        (args.temperature < 0, "--temperature must be >= 0"),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(message)
    url = urlsplit(args.base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"--base-url must be an http(s) URL, got {args.base_url!r}")


async def _resolve_model(args: argparse.Namespace, headers: dict[str, str]) -> tuple[str, Any]:
    url = args.base_url.rstrip("/") + "/v1/models"
    try:
        models = await get_json(url, headers)
    except (asyncio.TimeoutError, OSError, ProtocolError, HTTPStatusError, ValueError,
            asyncio.IncompleteReadError) as e:
        if args.model is not None:  # not needed: carry on without the server's description
            return args.model, None
        why = str(e) if isinstance(e, HTTPStatusError) else f"{type(e).__name__}: {e}; is the server up?"
        raise ValueError(f"cannot list the models at {url} ({why}); or pass --model") from None
    if args.model is not None:
        return args.model, models
    try:
        return models["data"][0]["id"], models
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"{url} lists no model; pass --model") from None


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark the flags describe and return the result document (what --result-file holds)."""
    check_args(args)
    machine = client_machine_info()
    api_key = args.api_key or os.environ.get("EMBER_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model, models = await _resolve_model(args, headers)
    specs = make_requests(args)
    _raise_open_files_limit(min(len(specs), args.max_concurrency or len(specs)) + 64)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
    print(f"{len(specs)} requests to {args.base_url.rstrip('/')}{args.endpoint} (model {model}), request rate "
          f"{rate}, max concurrency {args.max_concurrency or 'unlimited'}", flush=True)
    results, duration, max_in_flight = await run_requests(args, model, specs, headers)
    summary = summarize(results, duration, max_in_flight)
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key", "command", "bench_command")}
    config["request_rate"] = None if math.isinf(args.request_rate) else args.request_rate  # JSON has no inf
    config["api_key_set"] = bool(api_key)
    return {"benchmark": "serve", "date": datetime.date.today().isoformat(), "label": args.label,
            "machine": machine, "command": list(sys.argv),
            "server": {"base_url": args.base_url, "endpoint": args.endpoint, "model": model,
                       "models": models.get("data") if isinstance(models, dict) else None},
            "config": config, "results": summary, "requests": request_records(results, args.save_detailed)}


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Exit status 0 when at least one request succeeded, 1 when all failed (the report says why)."""
    doc = asyncio.run(benchmark(args))
    if args.result_file:  # first: the numbers are kept even if printing fails (a closed pipe)
        os.makedirs(os.path.dirname(os.path.abspath(args.result_file)), exist_ok=True)
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    print_report(doc["results"], args.label)
    if args.result_file:
        print(f"wrote {args.result_file}")
    return 0 if doc["results"]["completed"] else 1


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`ember bench serve ...` under `ember`'s subcommands."""
    bench = subparsers.add_parser("bench", help="benchmark clients (serve: load a running OpenAI-compatible server)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser("serve", help="measure TTFT, TPOT, ITL, latency and throughput of a running server",
                             description=__doc__.split("\n\n")[0])
    add_serve_bench_args(serve)
    serve.set_defaults(func=cmd_bench_serve)
    return bench


def main(argv: list[str] | None = None) -> int:
    """`python -m ember.bench.serve ...`, the same as `ember bench serve ...`."""
    parser = argparse.ArgumentParser(prog="ember bench serve", description=__doc__.split("\n\n")[0])
    add_serve_bench_args(parser)
    try:
        return cmd_bench_serve(parser.parse_args(argv))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
