"""Helpers every benchmark shares, so that all result files describe their machine and code the same way.

A number is only worth comparing with another when we know what produced it: the hardware, the
torch build, and the exact Ember commit (marked "+dirty" when the tree had uncommitted changes).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
from typing import Any

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")


def today() -> str:
    return datetime.date.today().isoformat()


def git_commit() -> str | None:
    """HEAD of the repository, with "+dirty" when files differ from it; None outside git or before the first commit."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if head is None:  # a copy without .git (e.g. on a lent GPU machine): the caller may say which commit it is
        return os.environ.get("EMBER_COMMIT")
    return head + ("+dirty" if git("status", "--porcelain") else "")


def _cpu_model() -> str:
    """/proc/cpuinfo names the CPU on Linux; platform.processor() is often empty there but works elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load: a shared machine busy with other work makes CPU timings meaningless."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine_info() -> dict[str, Any]:
    """Take it before the benchmark runs, so that `loadavg` shows what else was running."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "hostname": socket.gethostname(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": _ram_gib(),
        "gpu": ", ".join(gpus) or None,
        "torch": torch.__version__,
        "ember_commit": git_commit(),
        "loadavg": load_average(),
    }


def write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
