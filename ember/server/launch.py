"""`ember serve` and `python -m ember.server.launch`: bind the port, start the engine core, then serve.

The order is the point: a taken port fails in a fraction of a second with no core to stop, and the
core's torch import and model load run while this process imports the web stack (`ember.server.serve`,
imported only once the core is on its way) and builds the tokenizer.
"""

from __future__ import annotations

import argparse
import gc
import socket
import sys

from ember import heap, timeline
from ember.frontend.core_client import make_client
from ember.server.args import add_serve_args, resolve_args, settings_from_args


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound; a ValueError saying why when it cannot be (port taken)."""
    try:
        family, type_, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, type_, proto)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def cmd_serve(ns: argparse.Namespace) -> int:
    """Bind the port, start the engine core, then import the web stack and serve: the core's torch
    import and model load run while this process imports FastAPI and builds the tokenizer. The port
    comes first so that a taken one fails in a fraction of a second, with no core to stop."""
    timeline.mark("front end imported")
    ns = resolve_args(ns)
    args, settings = settings_from_args(ns)
    sock = bind_socket(ns.host, ns.port)
    try:
        client = make_client(args, args.engine_process is not False)
    except BaseException:
        sock.close()
        raise
    timeline.mark("core spawned" if args.engine_process is not False else "core loaded in process")
    # Here, not sooner: a torchrun follower rank never returns from make_client. On until the server is
    # ready (ember.server.serve settles).
    heap.pause_collection()
    try:
        from ember.server.serve import run_server

        gc.freeze()  # the modules' objects: the collection that ends start-up then skips them
        timeline.mark("web stack imported")
    except BaseException:
        sock.close()
        client.shutdown()
        raise
    return run_server(ns, sock, args, settings, client)


def main(argv: list[str] | None = None) -> int:
    """`python -m ember.server.launch ...`, the same as `ember serve ...`."""
    parser = argparse.ArgumentParser(prog="ember serve", description="Ember's OpenAI-compatible server")
    add_serve_args(parser)
    try:
        return cmd_serve(parser.parse_args(argv))
    except ValueError as e:  # bad flags, bad model files, a taken port: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
