"""One DEBUG line per model file parsed and per tokenizer built: what, from which file, how long, in
which process. `EMBER_LOGGING_LEVEL=DEBUG ember serve` shows them for the front end and the engine
core alike, and tests/test_parse_once.py counts them: each file is parsed once per process."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

logger = logging.getLogger("ember")
PREFIX = "model read:"
PARSED_GGUF = "parsed GGUF"
PARSED_JSON = "parsed JSON"
BUILT_TOKENIZER = "built tokenizer"


@contextlib.contextmanager
def logged_read(what: str, path: str) -> Iterator[None]:
    """Log `what` (PARSED_GGUF, PARSED_JSON, BUILT_TOKENIZER) of `path` once the block succeeds."""
    start = time.perf_counter()
    yield
    logger.debug("%s %s %s in %.3f s (pid %d)", PREFIX, what, path, time.perf_counter() - start, os.getpid())
