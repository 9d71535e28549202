"""Start-up's memory housekeeping, shared by the front end and the engine core.

Start-up makes hundreds of thousands of objects that live as long as the process (the modules of
torch or of the web stack, the model's layers, the tokenizer), and each automatic collection walks
all of them again. So each process turns the collector off while it starts (`pause_collection`) and,
once ready, `settle`s: one collection for start-up's garbage cycles, everything alive then frozen
out of all later collections (shorter pauses while serving), the collector back on, and the C
heap's free memory handed back to the OS.

Measured on a 2-core EPYC VM, 2026-12-05 (CPU seconds in the importing process, medians of 7):
importing the engine core's modules 1.03 s with the collector off against 1.19 s with it on; the
web stack 0.55 s against 0.59 s. The front end's trim after building the default model's tokenizer
returned 5.3 MiB (93.0 -> 87.7 MiB).
"""

from __future__ import annotations

import ctypes
import gc


def pause_collection() -> None:
    """No automatic collections until `settle`."""
    gc.disable()


def settle() -> None:
    """Start-up is over: collect its garbage cycles, freeze what is alive out of later collections, turn
    the collector back on and trim the heap."""
    gc.collect()
    gc.freeze()
    gc.enable()
    trim()


def trim() -> None:
    """Hand the C heap's free memory back to the OS (glibc's malloc_trim): glibc keeps what a process
    freed for its own later use, and a start-up frees much that it never needs again."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass
