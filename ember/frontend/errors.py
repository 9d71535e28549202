"""Errors a front end raises to its callers when a request or the engine cannot go on."""


class EngineStartError(ValueError):
    """The engine core could not start; the message is its own exception."""


class EngineDeadError(RuntimeError):
    """The engine core stopped (its process died, or its loop failed): no request can run any more."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine core; other requests are unaffected."""


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_waiting_requests` already; retry later."""
