"""Every benchmark script must at least start: imports resolve and the flags parse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# Scripts have a __main__ block; the helper modules they import (common.py, step_profile.py) have none.
SCRIPTS = sorted(
    p.name
    for p in (Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py")
    if 'if __name__ == "__main__":' in p.read_text()
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_starts(script):
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--help"], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout
