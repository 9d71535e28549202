"""Start-up timeline: named moments of a server's start, logged as seconds since its process started.

`mark(name)` notes a moment on `time.monotonic()`'s clock, which on Linux is one clock for every
process of the machine, so the engine core's moments (sent with its ready message, see
`ember.core.process`) and the front end's fall on one line. `ember serve` logs that line once
/health answers 200: where a start's seconds go, from one run on any machine, without a profiler.
A mark is a tuple appended to a short list (under a microsecond); nothing else runs unless the
line is logged.
"""

from __future__ import annotations

import os
import time
from collections import deque

Mark = tuple[str, float]  # (what happened, time.monotonic() when it did)
_marks: deque[Mark] = deque(maxlen=32)  # bounded: a process that starts many engines (tests) keeps the last


def mark(name: str, at: float | None = None) -> None:
    """Note that `name` happened now (or at `at`, on time.monotonic()'s clock)."""
    _marks.append((name, time.monotonic() if at is None else at))


def take() -> list[Mark]:
    """The marks noted in this process so far, which are then forgotten."""
    marks = list(_marks)
    _marks.clear()
    return marks


def process_start() -> float:
    """When this process started, on time.monotonic()'s clock: from its start time in /proc (10 ms
    ticks since boot), so the interpreter's own start and the first imports count too. Where /proc
    is missing, the import of this module."""
    try:
        with open("/proc/self/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5)
        return time.monotonic() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started_after_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


def summary(marks: list[Mark], origin: float) -> str:
    """`marks` in time order as 'name 1.23s' (seconds since `origin`), joined by commas."""
    return ", ".join(f"{name} {at - origin:.2f}s" for name, at in sorted(marks, key=lambda m: m[1]))


_IMPORTED = time.monotonic()
