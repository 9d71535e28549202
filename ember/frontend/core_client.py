"""How a front end talks to its engine core: in-process or in the core's own process, one interface.

`send` queues an input message, `get_output` returns the core's next output messages (waiting up
to `timeout`), `shutdown` ends the core. `InprocClient` (`ember.core.inproc_client`) runs the core's
loop in the caller's thread on `get_output` (`LLM`, `ember generate`, tests that patch the core); `MPClient` starts
`ember.core.process` and speaks msgpack over two ZMQ ipc sockets (`ember serve`,
`AsyncLLM`, and `LLM(engine_process=True)`).

A core process that dies is noticed by `get_output` within `_POLL_S`: it then returns an
`EngineCoreFailed` with the core's own last words (or its exit status), once, and the front end
fails every request instead of waiting forever. A core that stops answering without dying (SIGSTOP,
a deadlock) is noticed by its heartbeats (`HangWatch`), then killed and reported the same way.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time

import zmq

from ember.config import EngineArgs, EngineConfig
from ember.frontend import core_spawn
from ember.frontend.errors import EngineStartError
from ember.messages import (
    CoreBootstrap,
    CoreInput,
    CoreOutput,
    EngineCoreClient,
    EngineCoreFailed,
    EngineCoreHeartbeat,
    EngineCoreReady,
    UtilityCall,
    decode_output,
    encode,
)
from ember.torchrun import launched_by_torchrun

logger = logging.getLogger("ember")
_POLL_S = 0.1  # how often a waiting client checks that the core process is alive
_SHUTDOWN_CALL_ID = -1
HEARTBEAT_TIMEOUT_ENV = "EMBER_ENGINE_HEARTBEAT_TIMEOUT_S"
ITERATION_TIMEOUT_ENV = "EMBER_ENGINE_ITERATION_TIMEOUT_S"
_HEARTBEAT_TIMEOUT_S = 4.5  # silence after which a core counts as stopped: detected in <= 5 s with the 0.1 s poll
_ITERATION_TIMEOUT_S = 60.0  # one loop iteration (a step) running this long counts as a deadlock
_HEARTBEATS_PER_TIMEOUT = 5  # the core's heartbeat interval: the timeout / 5, at most 1 s
_LAST_WORDS_MS = 1000  # how long a dead core's messages in flight are waited for
_KILL_WAIT_S = 5.0  # how long shutdown waits for a core killed as hung to go


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds (0: off), got {value!r}") from None


class HangWatch:
    """Tells a core process that stopped answering from a busy one, from what the client receives.

    The core's heartbeat thread sends an `EngineCoreHeartbeat` every second or so whatever its loop
    does (torch releases the GIL inside a step), so silence means the whole process stopped
    (SIGSTOP, a debugger, its I/O threads dead): `heartbeat_timeout`. A heartbeat that shows the
    loop inside one iteration for longer than `iteration_timeout` means a deadlock or a device that
    never finishes (under tensor parallelism, a rank stuck in a collective). Silence is counted only
    while the client waits for the core (`waited`), never between its calls: a front end that stops
    asking for output (an `LLMEngine` between steps, a front end paused itself) cannot mistake the
    pause for the core's. A timeout of 0 or less turns its check off."""

    def __init__(
        self, heartbeat_timeout: float = _HEARTBEAT_TIMEOUT_S, iteration_timeout: float = _ITERATION_TIMEOUT_S
    ) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.iteration_timeout = iteration_timeout
        self.silent_s = 0.0  # time waited since the last message
        self.step_s = 0.0  # the loop's time in its current iteration, as of the last message
        self.iteration = 0

    @classmethod
    def from_env(cls) -> HangWatch:
        return cls(
            _env_seconds(HEARTBEAT_TIMEOUT_ENV, _HEARTBEAT_TIMEOUT_S),
            _env_seconds(ITERATION_TIMEOUT_ENV, _ITERATION_TIMEOUT_S),
        )

    @property
    def heartbeat_interval(self) -> float:
        """What the core should use: several heartbeats per timeout; 0 (none) when both checks are off."""
        if self.heartbeat_timeout <= 0:
            return 1.0 if self.iteration_timeout > 0 else 0.0
        return min(1.0, self.heartbeat_timeout / _HEARTBEATS_PER_TIMEOUT)

    def heard(self, message: CoreOutput) -> None:
        """Any message from the core, in the order received."""
        self.silent_s = 0.0
        if isinstance(message, EngineCoreHeartbeat):
            self.iteration, self.step_s = message.iteration, message.step_s
        else:  # outputs leave the core between iterations: the one a heartbeat saw is over
            self.step_s = 0.0

    def waited(self, seconds: float) -> None:
        """The client waited this long for a message and none came."""
        self.silent_s += seconds

    def verdict(self) -> str | None:
        """Why the core counts as stopped, or None while it answers."""
        if 0 < self.heartbeat_timeout <= self.silent_s:
            return f"engine core stopped answering: no heartbeat for {self.silent_s:.1f}s"
        if 0 < self.iteration_timeout < self.step_s:
            return (
                f"engine core stopped answering: its loop has been in one step for {self.step_s:.1f}s "
                f"(iteration {self.iteration}; {ITERATION_TIMEOUT_ENV}={self.iteration_timeout:g})"
            )
        return None


class MPClient(EngineCoreClient):
    """Starts the core process at once; `wait_ready` then waits for its model to load, so the caller
    can do its own start-up (the web stack, the tokenizer) meanwhile."""

    def __init__(self, config: EngineConfig) -> None:
        self._dir = tempfile.mkdtemp(prefix="ember-core-")
        self._ctx = zmq.Context()
        self._input = self._bind(zmq.PUSH, "in")
        self._output = self._bind(zmq.PULL, "out")
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._watch = HangWatch.from_env()
        self._watching = False  # from EngineCoreReady on: loading may take long and sends no heartbeats
        self._handshake: EngineCoreReady | None = None  # the core's EngineCoreReady, once received
        self.proc = core_spawn.spawn()
        boot = CoreBootstrap(config, self._address("in"), self._address("out"), self._watch.heartbeat_interval)
        assert self.proc.stdin is not None  # stdin=PIPE
        boot.write(self.proc.stdin)
        self._stopping = False
        self._hung = False  # killed by this client for not answering

    def _address(self, name: str) -> str:
        return f"ipc://{os.path.join(self._dir, name)}"

    def _bind(self, kind: int, name: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)
        sock.bind(self._address(name))
        return sock

    def wait_ready(self, timeout: float | None = None) -> EngineCoreReady:
        """The core's handshake, waited for once: a later call answers the one already received."""
        if self._handshake is not None:
            return self._handshake
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for message in self._receive(_POLL_S):
                if isinstance(message, EngineCoreReady):
                    self.ready = self._handshake = message
                    return message
                if isinstance(message, EngineCoreFailed):
                    self.shutdown()
                    raise EngineStartError(message.message)
            if deadline is not None and time.monotonic() > deadline:
                self.shutdown()
                raise EngineStartError(f"the engine core did not start within {timeout:g}s")

    def send(self, message: CoreInput) -> None:
        """Never blocks: a PUSH socket would wait forever for a core that died (its peer is gone)."""
        try:
            self._input.send(encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.debug("engine core not connected; dropped a %s", type(message).__name__)

    def get_output(self, timeout: float | None = None) -> list[CoreOutput]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
            messages = self._receive(remaining)
            if messages or (deadline is not None and time.monotonic() >= deadline):
                return messages

    def _receive(self, timeout: float) -> list[CoreOutput]:
        """What has arrived (waiting up to `timeout` for the first); a dead core's last words once."""
        if self.failure is not None:
            return []
        start = time.monotonic()
        if self._poller.poll(int(timeout * 1000)):  # what pyzmq does with a float
            return self._read_arrived() or self._check_answering()
        code = self.proc.poll()
        if self._stopping:
            return []
        if code is not None:
            # What the core sent before it exited may still be on its way (its socket lingers until
            # the bytes leave, not until they are read): a failure it explained beats an exit code.
            last = self._read_arrived() if self._poller.poll(_LAST_WORDS_MS) else []
            if self.failure is not None:
                return last
            self.failure = _exit_description(code)
            logger.error("%s (pid %d)", self.failure, self.proc.pid)
            return [*last, EngineCoreFailed(self.failure)]
        # At most the time asked for: a wait that took longer (this process paused) is not the core's.
        self._watch.waited(min(time.monotonic() - start, timeout))
        return self._check_answering()

    def _read_arrived(self) -> list[CoreOutput]:
        """Every message queued on the output socket, without waiting; heartbeats only feed the watch."""
        messages: list[CoreOutput] = []
        while True:
            try:
                frame = self._output.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages
            message = decode_output(frame.buffer)
            self._watching |= isinstance(message, EngineCoreReady)
            self._watch.heard(message)
            if isinstance(message, EngineCoreHeartbeat):  # the client's business only
                continue
            if isinstance(message, EngineCoreFailed):
                self.failure = message.message
            messages.append(message)

    def _check_answering(self) -> list[CoreOutput]:
        """[] while the core answers; else kill it (SIGKILL ends a stopped process too) and report it
        as dead, once."""
        verdict = self._watch.verdict() if self._watching and not self._stopping else None
        if verdict is None:
            return []
        self.failure = verdict
        self._hung = True
        logger.error("%s (pid %d); killing it", verdict, self.proc.pid)
        self.proc.kill()
        return [EngineCoreFailed(verdict)]

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, give it `timeout` seconds, then kill it; nothing is left behind."""
        if self._stopping:
            return
        self._stopping = True
        if self._hung:  # killed already: only reap it (not forever: a process stuck in a driver may linger)
            try:
                self.proc.wait(_KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                logger.error("engine core (pid %d) still there %gs after SIGKILL", self.proc.pid, _KILL_WAIT_S)
        elif self.proc.poll() is None:
            self.send(UtilityCall(_SHUTDOWN_CALL_ID, "shutdown"))
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                if timeout > 0:  # 0: the caller knows the core cannot be of use (the model failed to load)
                    logger.warning("engine core did not stop within %gs; killing it", timeout)
                self.proc.kill()
                self.proc.wait()
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


def _exit_description(code: int) -> str:
    if code < 0:
        return f"engine core process was killed by {signal.Signals(-code).name}"
    return f"engine core process exited with code {code}"


def make_client(args: EngineArgs, engine_process: bool) -> EngineCoreClient:
    """The client for this process's role, its core started from the flags' `EngineConfig`. Under
    torchrun, ranks other than 0 become followers of rank 0's core here and never return."""
    config = args.engine_config()
    if config.tensor_parallel_size > 1 and launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        from ember.runner.tp_workers import serve_as_torchrun_worker

        serve_as_torchrun_worker(config)
    if engine_process:
        return MPClient(config)
    from ember.core.inproc_client import InprocClient  # the one door from a front end into the core (torch)

    return InprocClient(config)
