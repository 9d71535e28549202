"""Helpers every benchmark shares, so that all result files describe their machine and code the same way,
and so that every benchmark that spawns a server starts, waits for and stops it the same way.

A number is only worth comparing with another when we know what produced it: the hardware, the
torch build, and the exact Ember commit (marked "+dirty" when the tree had uncommitted changes).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

from ember.bench.machine import REPO_ROOT, basic_machine_info
from ember.http_client import http_request

# The device in `ember serve`'s start-up line: "serving NAME at URL (model PATH on cpu (float32, ...): N KV blocks".
READY_LINE_DEVICE = re.compile(r"serving .* on (cpu|cuda(?::\d+)?|mps|xpu)\b")

RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")


def today() -> str:
    return datetime.date.today().isoformat()


def _ram_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def machine_info() -> dict[str, Any]:
    """Take it before the benchmark runs, so that `loadavg` shows what else was running."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        **basic_machine_info(),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": _ram_gib(),
        "gpu": ", ".join(gpus) or None,
        "torch": torch.__version__,
    }


def cuda_graph_us(fn, rep_ms: int, return_mode: str = "mean") -> float:
    """Triton's do_bench_cudagraph of fn, in microseconds, once the device is idle. do_bench_cudagraph runs fn
    on a stream of its own, which does not wait for the default stream: its first call may read inputs still
    being written (mla_decode.py's random block tables: an illegal memory access on an H100 that
    CUDA_LAUNCH_BLOCKING=1 hid, 2026-12-07)."""
    import triton.testing

    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode=return_mode) * 1e3


def write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def server_benchmark_parser(argv: list[str], doc: str) -> tuple[argparse.ArgumentParser, list[str], list[str]]:
    """The parser of a benchmark that starts `ember serve` itself (with `--model`), this script's
    arguments and those after `--`, which go to `ember serve` unchanged."""
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], epilog="Arguments after `--` go to `ember serve` unchanged."
    )
    p.add_argument("--model", default=None, help="what `ember serve` loads (default: its default model)")
    return p, argv, extra


# ---- a server in a child process ------------------------------------------------------------------


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(model: str | None, host: str, port: int, extra: list[str]) -> list[str]:
    """The `ember` console script of this Python's environment, or `python -m ember.cli`, which is the same."""
    script = os.path.join(os.path.dirname(sys.executable), "ember")
    base = [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "ember.cli"]
    return [*base, "serve", *([model] if model else []), "--host", host, "--port", str(port), *extra]


def health(host: str, port: int, timeout: float = 2.0) -> int | None:
    """HTTP status of GET /health, or None while nothing answers."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def wait_ready(proc: subprocess.Popen, host: str, port: int, start: float, timeout: float) -> float:
    """Seconds from `start` to /health answering 200, polled every 50 ms as benchmarks/startup.py does."""
    while (status := health(host, port)) != 200:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"not ready after {timeout:g} s (last /health status {status})")
        time.sleep(0.05)
    return time.perf_counter() - start


def stop(proc: subprocess.Popen, wait: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:  # it did not stop by itself: end its whole process group
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class ServerProcess:
    """A server (`ember serve` or another that answers /health) spawned in a session of its own, its output in a
    temporary file; a context manager that stops it on the way out.

        with ServerProcess(server_command(model, host, port, flags), host, port) as server:
            startup_s = server.wait_ready(timeout)
            ...  # server.url, server.proc; server.log_tail() for what it printed
    """

    def __init__(self, cmd: list[str], host: str, port: int) -> None:
        self.cmd, self.host, self.port = cmd, host, port
        self.url = f"http://{host}:{port}"
        self._log = tempfile.TemporaryFile("w+", encoding="utf-8")
        self._output: str | None = None  # the whole log, kept once the server has stopped
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )

    def wait_ready(self, timeout: float) -> float:
        """Seconds from the spawn to /health answering 200; RuntimeError if it exits or takes over `timeout`."""
        return wait_ready(self.proc, self.host, self.port, self.start, timeout)

    def output(self) -> str:
        """What the server printed so far. Read at an offset (pread), never by seeking: the server writes through
        the same open file, and moving its offset would make it overwrite the log."""
        if self._output is not None:
            return self._output
        fd = self._log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode("utf-8", "replace")

    def log_tail(self, lines: int = 20) -> list[str]:
        return self.output().splitlines()[-lines:]

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            stop(self.proc)
        finally:
            self._output = self.output()
            self._log.close()


class ServerError(RuntimeError):
    """A RuntimeError while a spawned server started or was in use, with the server's last lines of output."""

    def __init__(self, message: str, log_tail: list[str]) -> None:
        super().__init__(message)
        self.log_tail = log_tail


@contextlib.contextmanager
def ember_server(model: str | None, flags: list[str], timeout: float) -> Iterator[ServerProcess]:
    """`ember serve` on a free local port with `flags`; yields it once /health answers 200. A RuntimeError, while
    starting or while it is in use, prints the server's last lines to stderr and leaves as a ServerError."""
    host = "127.0.0.1"
    port = free_port(host)
    with ServerProcess(server_command(model, host, port, flags), host, port) as server:
        try:
            server.wait_ready(timeout)
            yield server
        except ServerError:  # another server's, already reported
            raise
        except RuntimeError as e:
            tail = server.log_tail()
            print("server log:\n" + "\n".join(tail), file=sys.stderr)
            raise ServerError(str(e), tail) from e


async def reset_prefix_cache(base_url: str) -> None:
    """`POST /reset_prefix_cache`, so that a run finds nothing of another's prompts cached."""
    resp = await http_request("POST", base_url + "/reset_prefix_cache")
    try:
        body = await resp.read()
    finally:
        await resp.close()
    if resp.status != 200:
        raise RuntimeError(f"POST /reset_prefix_cache answered {resp.status}: {body[:200]!r}")


def bar_chart(
    path: str, bars: dict[str, float], title: str, ylabel: str, lines: dict[str, float] | None = None
) -> bool:
    """One bar per entry, with optional labelled horizontal lines (a target, a roofline). matplotlib is no
    project dependency: without it there is no chart, and False says so."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.bar_label(ax.bar(list(bars), list(bars.values()), color="#d9541e"), fmt="%.1f", fontsize=8)
    for i, (label, y) in enumerate((lines or {}).items()):
        ax.axhline(y, color=["black", "gray", "#4a7ab5"][i % 3], linestyle=["-", "--", ":"][i % 3], label=label)
    if lines:
        ax.legend(fontsize=7)
    ax.set_ylabel(ylabel)
    ax.tick_params(labelsize=8)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
