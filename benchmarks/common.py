"""Helpers every benchmark shares, so that all result files describe their machine and code the same way.

A number is only worth comparing with another when we know what produced it: the hardware, the
torch build, and the exact Ember commit (marked "+dirty" when the tree had uncommitted changes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
from typing import Any

import torch

from ember.bench.machine import REPO_ROOT, basic_machine_info

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
