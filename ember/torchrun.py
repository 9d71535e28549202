"""Whether torchrun started this process, from its environment alone: `ember serve` asks before it
imports anything else (ember.frontend.core_spawn), the engine's set-up after."""

from __future__ import annotations

import os


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))
