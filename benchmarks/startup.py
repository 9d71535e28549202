"""Start-up: seconds from spawning `ember serve` to `GET /health` answering 200, peak memory, and a clean stop.

The design doc's setting is the default model on CPU and the Qwen3-0.6B shape on GPU. Each run
spawns a fresh server on a free port and polls /health every 50 ms; it records when the port first
answers at all (503 while the model loads) and when it answers 200. Memory is the resident set of
the server's process tree, sampled at each poll (plus the kernel's high-water mark VmHWM of the
main process, which catches peaks between samples), and, where `nvidia-smi` exists, the GPU memory
it reports for those processes once ready. Then the server gets SIGTERM; the run records its exit
status and how long it took to stop. The server's own start-up timeline (its log line of moments in
seconds since its process started: imports, core spawned, model loaded, KV allocated, CUDA graphs,
core ready, ...; see ember/timeline.py) is kept per run, and its per-moment medians in the summary.

    python benchmarks/startup.py --repeat 3 -- --kv-cache-memory 1                       # default model, CPU
    python benchmarks/startup.py --model benchmarks/configs/qwen3-0.6b --repeat 3 -- --load-format dummy   # GPU

Everything after `--` goes to `ember serve` unchanged.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    READY_LINE_DEVICE,
    RESULTS_DIR,
    free_port,
    health,
    machine_info,
    server_benchmark_parser,
    server_command,
    today,
    write_json,
)
from benchmarks.throughput import model_short_name
from ember.bench.machine import load_average

_PAGE = os.sysconf("SC_PAGE_SIZE")
_TIMELINE_LINE = "start-up, seconds since the process started: "
_MARK = re.compile(r"([^,]+?) (\d+\.\d+)s(?:, |$)")
MEDIAN_KEYS = (
    "port_answers_s",
    "ready_s",
    "peak_rss_tree_mib",
    "main_vmhwm_mib",
    "rss_ready_mib",
    "gpu_memory_used_mib",
    "shutdown_s",
)


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants, from the parent ids in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm", encoding="utf-8") as f:
                total += int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            pass
    return total / 2**20


def vmhwm_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def gpu_memory_mib(pids: list[int]) -> float | None:
    """What nvidia-smi reports for these processes; None without nvidia-smi or when it lists none of them
    (in a container it may see other pid numbers)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = [
        float(mem)
        for pid, mem in (line.split(",") for line in out.splitlines() if line.count(",") == 1)
        if pid.strip().isdigit() and int(pid) in pids and mem.strip().replace(".", "", 1).isdigit()
    ]
    return sum(used) if used else None


def one_run(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    port = free_port(args.host)
    cmd = server_command(args.model, args.host, port, extra)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    run: dict[str, Any] = {"loadavg_before": load_average(), "server_command": cmd, "error": None}
    with tempfile.TemporaryFile("w+", encoding="utf-8") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        port_answers = ready = None
        first_status = None
        peak = 0.0
        try:
            while True:
                status = health(args.host, port)
                now = time.perf_counter() - start
                tree = process_tree(proc.pid)
                peak = max(peak, rss_mib(tree))
                if status is not None and port_answers is None:
                    port_answers, first_status = now, status
                if status == 200:
                    ready = now
                    break
                if proc.poll() is not None:
                    run["error"] = f"the server exited with status {proc.returncode} before it was ready"
                    break
                if now > args.timeout:
                    run["error"] = f"not ready after {args.timeout:g} s"
                    break
                time.sleep(max(0.0, args.poll_interval - (time.perf_counter() - start - now)))
            if ready is not None:
                tree = process_tree(proc.pid)
                run["rss_ready_mib"] = round(rss_mib(tree), 1)
                peak = max(peak, run["rss_ready_mib"])
                run["main_vmhwm_mib"] = vmhwm_mib(proc.pid)
                run["gpu_memory_used_mib"] = gpu_memory_mib(tree)
        finally:
            stop = time.perf_counter()
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=args.shutdown_wait)
                run["killed"] = False
            except subprocess.TimeoutExpired:  # it did not stop by itself: end its whole process group
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                run["killed"] = True
            run["shutdown_s"] = round(time.perf_counter() - stop, 3)
            run["exit_code"] = proc.returncode
        log.seek(0)
        text = log.read()
    match = READY_LINE_DEVICE.search(text)
    run.update(
        port_answers_s=None if port_answers is None else round(port_answers, 3),
        first_status=first_status,
        ready_s=None if ready is None else round(ready, 3),
        peak_rss_tree_mib=round(peak, 1),
        device=match.group(1) if match else None,
        ready_line=next((line for line in text.splitlines() if "serving" in line), None),
        timeline=server_timeline(text),
    )
    if run["error"] is not None:
        run["log_tail"] = text.splitlines()[-20:]
    return run


def server_timeline(log: str) -> dict[str, float] | None:
    """The server's start-up moments from its log line, {name: seconds since its process started}."""
    line = next((line for line in log.splitlines() if _TIMELINE_LINE in line), None)
    if line is None:
        return None
    return {m[1]: float(m[2]) for m in _MARK.finditer(line.split(_TIMELINE_LINE, 1)[1])}


def timeline_medians(runs: list[dict[str, Any]]) -> dict[str, float] | None:
    timelines = [r["timeline"] for r in runs if r.get("timeline")]
    if not timelines:
        return None
    first_seen = list(dict.fromkeys(n for t in timelines for n in t))  # each run's own order breaks ties
    medians = {n: round(statistics.median(t[n] for t in timelines if n in t), 3) for n in first_seen}
    return dict(sorted(medians.items(), key=lambda item: item[1]))  # a stable sort


def median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p, argv, extra = server_benchmark_parser(argv, __doc__)
    p.add_argument("--repeat", type=int, default=3, help="fresh server starts; each is reported, and the median")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--poll-interval", type=float, default=0.05, help="seconds between /health polls")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take before it counts as failed")
    p.add_argument("--shutdown-wait", type=float, default=60.0, help="seconds after SIGTERM before SIGKILL")
    p.add_argument(
        "--out", default=None, help="JSON path (default: benchmarks/results/startup-<model>-<device>-<date>.json)"
    )
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    machine = machine_info()
    runs = []
    for i in range(args.repeat):
        run = one_run(args, extra)
        runs.append(run)
        print(
            f"run {i + 1}: port answers {run['port_answers_s']} s, ready {run['ready_s']} s, peak RSS "
            f"{run['peak_rss_tree_mib']} MiB (VmHWM {run.get('main_vmhwm_mib')}), GPU {run.get('gpu_memory_used_mib')}"
            f" MiB, exit {run['exit_code']} after {run['shutdown_s']} s"
            + (f"; {run['error']}" if run["error"] else ""),
            flush=True,
        )
    summary = {key: median(runs, key) for key in MEDIAN_KEYS}
    summary["timeline"] = timeline_medians(runs)
    summary["failed_runs"] = sum(r["error"] is not None for r in runs)
    summary["clean_exits"] = sum(r["exit_code"] == 0 and not r["killed"] for r in runs)
    print(
        f"median of {len(runs)}: port answers {summary['port_answers_s']} s, ready {summary['ready_s']} s, "
        f"peak RSS {summary['peak_rss_tree_mib']} MiB, shutdown {summary['shutdown_s']} s"
    )
    device = next((r["device"] for r in runs if r["device"]), None) or "unknown"
    out = args.out or os.path.join(
        RESULTS_DIR, f"startup-{model_short_name(args.model)}-{device.split(':')[0]}-{today()}.json"
    )
    write_json(
        out,
        {
            "benchmark": "startup",
            "date": today(),
            "machine": machine,
            "command": sys.argv,
            "config": {**vars(args), "server_args": extra, "server_command": runs[0]["server_command"]},
            "results": {"median": summary, "runs": runs},
        },
    )
    if summary["timeline"]:
        print("server timeline, medians: " + ", ".join(f"{n} {t:.2f}s" for n, t in summary["timeline"].items()))
    print(f"wrote {out}")
    return 0 if summary["failed_runs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
