"""`python -m ember.integrations.ray_serve [MODEL] [ember serve flags] --num-replicas N ...`"""

from __future__ import annotations

import argparse
import sys

import ray
from ray import serve

from ember.integrations.ray_serve.app import build_application, parse


def main(argv: list[str] | None = None) -> int:
    try:
        engine_args, settings, options, ns = parse(sys.argv[1:] if argv is None else argv)
    except (ValueError, argparse.ArgumentError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ray.init(address=ns.ray_address)
    serve.start(http_options={"host": ns.host, "port": ns.port})
    serve.run(
        build_application(engine_args, settings, options, ns.max_waiting_requests),
        name="ember",
        route_prefix="/",
        blocking=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
