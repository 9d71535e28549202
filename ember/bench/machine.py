"""What produced a benchmark number: the machine and the exact Ember commit.

Shared by `ember bench serve` and the scripts in benchmarks/; no torch import, so the serving client
stays light.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_model() -> str:
    """/proc/cpuinfo names the CPU on Linux; platform.processor() is often empty there but works elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """HEAD of the checkout Ember runs from, "+dirty" when files differ from it; else $EMBER_COMMIT
    (a copy without .git, e.g. on a lent GPU machine, where the caller says which commit it is)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    head = git("rev-parse", "HEAD") if os.path.exists(os.path.join(REPO_ROOT, ".git")) else None
    if head is None:
        return os.environ.get("EMBER_COMMIT")
    return head + ("+dirty" if git("status", "--porcelain") else "")


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load: a shared machine busy with other work makes CPU timings meaningless."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def basic_machine_info() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "ember_commit": git_commit(),
        "loadavg": load_average(),
    }


def client_machine_info() -> dict[str, Any]:
    """The machine the client ran on (often the server's too); no torch import needed."""
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {**basic_machine_info(), "torch": version("torch"), "ember": version("ember")}
