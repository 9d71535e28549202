"""The engine core's own process: `python -m ember.core.process`, started by `MPClient`.

Three threads. The main thread runs the `CoreLoop` (schedule, launch, collect); an input thread
receives and decodes the front end's messages; an output thread encodes and sends each step's
outputs. ZMQ's send and receive release the GIL, so (de)serialisation overlaps the next step's
device work instead of adding to it, and the front end's HTTP work never competes with the
engine for a GIL at all. Once ready, a fourth thread queues an `EngineCoreHeartbeat` (the loop's
progress) every `heartbeat_interval` seconds: a core that stops answering (SIGSTOP, a deadlock)
is then noticed by the front end (`MPClient`), while a long step still sends heartbeats.

Start-up: the front end writes one `CoreBootstrap` (the `EngineConfig`, socket addresses) to this
process's stdin and keeps the pipe open. EOF on it means the front end is gone, even by kill -9:
the core then exits at once instead of living on as an orphan (tensor-parallel ranks watch the
core the same way). The core ignores SIGINT and SIGTERM: a Ctrl-C in a terminal or systemd's
SIGTERM to the whole service reaches the front end too, which drains its requests and then asks
the core to stop. A core that cannot start sends `EngineCoreFailed` with its exception and exits 1.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import sys
import threading
from typing import TYPE_CHECKING

import msgspec
import zmq

from ember import heap, timeline
from ember.messages import (
    BOOTSTRAP_LENGTH,
    CoreBootstrap,
    CoreOutput,
    EngineCoreFailed,
    EngineCoreHeartbeat,
    decode_input,
    encode,
)

if TYPE_CHECKING:
    from ember.core.loop import CoreLoop

logger = logging.getLogger("ember")
_LINGER_MS = 5000  # how long closing waits for queued outputs to leave


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError("the front end closed the engine core's stdin before sending its arguments")
        data += chunk
    return data


def _read_bootstrap() -> CoreBootstrap:
    """Read from the raw descriptor: a buffered sys.stdin would hold a lock that the watching thread
    keeps at interpreter exit."""
    (size,) = BOOTSTRAP_LENGTH.unpack(_read_exactly(0, BOOTSTRAP_LENGTH.size))
    return msgspec.msgpack.decode(_read_exactly(0, size), type=CoreBootstrap)


def _exit_when_front_end_dies() -> None:
    while os.read(0, 4096):  # returns b"" at EOF: the front end closed the pipe or died
        pass
    logger.error("engine core: the front end is gone; exiting")
    os._exit(1)


def _send_outputs(outputs: queue.SimpleQueue, sock: zmq.Socket) -> None:
    while (message := outputs.get()) is not None:
        sock.send(encode(message), copy=False)


def _send_heartbeats(outputs: queue.SimpleQueue, loop: CoreLoop, interval: float, stop: threading.Event) -> None:
    """Through the output thread, so that a heartbeat also proves that thread (and the socket) alive."""
    while not stop.wait(interval):
        outputs.put(EngineCoreHeartbeat(*loop.progress()))


def _receive_inputs(sock: zmq.Socket, loop: CoreLoop) -> None:
    try:
        while True:
            loop.put(decode_input(sock.recv(copy=False).buffer))
    except zmq.ContextTerminated:
        sock.close(linger=0)


def _failure(e: BaseException) -> EngineCoreFailed:
    return EngineCoreFailed(f"{type(e).__name__}: {e}")


def main() -> int:
    timeline.mark("core process started", timeline.process_start())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The collector stays off while the core starts (ember.heap: 1.03 s of CPU for these imports against
    # 1.19 s), and the imports' objects are frozen at once, so that the model's load, which collects
    # once (ember.runner.model_build), does not walk them again: 2 ms instead of 0.12 s under cProfile.
    heap.pause_collection()
    from ember.core.engine_core import EngineCore  # torch, and the model code
    from ember.core.loop import CoreLoop

    gc.freeze()
    timeline.mark("core imported")
    boot = _read_bootstrap()
    threading.Thread(target=_exit_when_front_end_dies, name="ember-core-parent", daemon=True).start()
    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.SNDHWM, 0)
    out_sock.connect(boot.output_address)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.RCVHWM, 0)
    in_sock.connect(boot.input_address)
    try:
        core = EngineCore(boot.config)
    except BaseException as e:  # reported to the front end, which shows it and exits
        if not isinstance(e, ValueError):  # bad flags or model files need no traceback; anything else does
            logger.exception("engine core failed to start")
        out_sock.send(encode(_failure(e)))
        # ctx.term() is what waits for the failure to leave (close only sets the linger): without it the
        # process exits with the message still queued, maybe before the connection was even made, and the
        # front end can only report an exit code (seen in CI: test_loader, under load).
        in_sock.close(linger=0)
        out_sock.close(linger=_LINGER_MS)
        ctx.term()
        return 1
    heap.settle()
    timeline.mark("core ready")
    out_sock.send(encode(msgspec.structs.replace(core.ready, timeline=timeline.take())))
    loop = CoreLoop(core)
    outputs: queue.SimpleQueue[CoreOutput | None] = queue.SimpleQueue()
    sender = threading.Thread(target=_send_outputs, args=(outputs, out_sock), name="ember-core-out")
    sender.start()
    threading.Thread(target=_receive_inputs, args=(in_sock, loop), name="ember-core-in", daemon=True).start()
    stop_heartbeat = threading.Event()
    if boot.heartbeat_interval > 0:
        threading.Thread(
            target=_send_heartbeats,
            args=(outputs, loop, boot.heartbeat_interval, stop_heartbeat),
            name="ember-core-heartbeat",
            daemon=True,
        ).start()
    code = 0
    try:
        loop.run(outputs.put)
    except BaseException as e:  # an engine bug or a device failure: the front end fails every request
        logger.exception("engine core stopped")
        outputs.put(_failure(e))
        core.shutdown()
        code = 1
    stop_heartbeat.set()
    outputs.put(None)
    sender.join()
    out_sock.close(linger=_LINGER_MS)
    ctx.term()
    return code


if __name__ == "__main__":
    exit_code = main()
    # Skip the interpreter's teardown (torch's modules and their atexit work): 0.3-0.4 s of an idle
    # SIGTERM on CPU, measured 2026-12-05. main() sent and closed everything the front end waits for.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
