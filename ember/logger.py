"""Ember's log output: INFO lines on stderr by default, level from EMBER_LOGGING_LEVEL."""

import logging
import os


def init_logging() -> None:
    logger = logging.getLogger("ember")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("EMBER_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False
