"""The Ray Serve application: N Ember replicas behind one OpenAI-compatible ingress.

Built from the same flags as `ember serve` (engine and server flags pass through to every
replica) plus the replica flags below, from the command line (`python -m
ember.integrations.ray_serve`) or from a mapping (`app_builder`, for `serve run` and KubeRay's
RayService).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from ember.config import EngineArgs
from ember.integrations.ray_serve.ingress import EmberIngress
from ember.integrations.ray_serve.replica import EmberReplica
from ember.integrations.ray_serve.router import PrefixAffinityRouter
from ember.server.args import (
    ServerSettings,
    add_serve_args,
    mapping_to_argv,
    resolve_args,
    settings_from_args,
)


@dataclass(frozen=True)
class ReplicaOptions:
    num_replicas: int = 1
    max_replicas: int | None = None  # autoscale between num_replicas and this on queue length
    target_ongoing_requests: int | None = None  # per replica, when autoscaling (default: --max-num-seqs)
    max_ongoing_requests: int | None = None  # per replica; more wait in the router (default: 2x --max-num-seqs)
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    prefix_chars: int = 256
    prefix_routing: bool = True

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.max_replicas is not None and self.max_replicas < self.num_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= num_replicas ({self.num_replicas})")
        for name in ("target_ongoing_requests", "max_ongoing_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.replica_cpus < 0 or self.replica_gpus < 0:
            raise ValueError("replica_cpus and replica_gpus must be >= 0")
        if self.prefix_chars < 1:
            raise ValueError(f"prefix_chars must be >= 1, got {self.prefix_chars}")


def add_replica_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Ray Serve replicas")
    g.add_argument("--num-replicas", type=int, default=1, help="engine replicas (the minimum when autoscaling)")
    g.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help="autoscale up to this many replicas on queue length (default: a fixed --num-replicas)",
    )
    g.add_argument(
        "--target-ongoing-requests",
        type=int,
        default=None,
        help="autoscaling target of requests in flight per replica (default: --max-num-seqs)",
    )
    g.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=None,
        help="requests in flight per replica; more wait in the router (default: 2x --max-num-seqs)",
    )
    g.add_argument("--replica-cpus", type=float, default=1.0, help="CPU cores each replica reserves")
    g.add_argument(
        "--replica-gpus",
        type=float,
        default=0.0,
        help="GPUs each replica owns (set it to --tensor-parallel-size on GPU clusters)",
    )
    g.add_argument(
        "--prefix-chars",
        type=int,
        default=256,
        help="prompt characters hashed to pick a replica (requests sharing them share one)",
    )
    g.add_argument(
        "--prefix-routing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="route by prompt prefix (--no-prefix-routing: least-loaded replica)",
    )
    g.add_argument("--ray-address", default=None, help="Ray cluster to join (default: $RAY_ADDRESS or a local one)")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ember.integrations.ray_serve",
        exit_on_error=False,
        description="Ember replicas on Ray Serve behind one OpenAI-compatible ingress",
    )
    add_serve_args(parser)
    add_replica_args(parser)  # after add_serve_args: these are not `--config` YAML keys
    return parser


def parse(argv: list[str]) -> tuple[EngineArgs, ServerSettings, ReplicaOptions, argparse.Namespace]:
    ns = resolve_args(make_parser().parse_args(argv))
    engine_args, settings = settings_from_args(ns)
    options = ReplicaOptions(**{f: getattr(ns, f) for f in ReplicaOptions.__dataclass_fields__})
    return engine_args, settings, options, ns


def build_application(
    engine_args: EngineArgs, settings: ServerSettings, options: ReplicaOptions, max_waiting_requests: int | None = None
) -> Application:
    seqs = engine_args.max_num_seqs
    max_ongoing = options.max_ongoing_requests or 2 * seqs
    scaling: dict[str, Any] = {"num_replicas": options.num_replicas}
    if options.max_replicas is not None:
        scaling = {
            "autoscaling_config": {
                "min_replicas": options.num_replicas,
                "max_replicas": options.max_replicas,
                "target_ongoing_requests": options.target_ongoing_requests or seqs,
            }
        }
    replica = serve.deployment(EmberReplica).options(  # type: ignore[attr-defined]  # Ray's overloads miss a class
        name="EmberReplica",
        max_ongoing_requests=max_ongoing,
        ray_actor_options={"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
        graceful_shutdown_timeout_s=settings.shutdown_timeout + 5,
        # the ignore: Ray annotates every keyword of RequestRouterConfig as dict[str, Any]
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,  # type: ignore[arg-type]
            request_router_kwargs={"prefix_routing": options.prefix_routing},
        ),
        **scaling,
    )
    ingress = serve.deployment(EmberIngress).options(  # type: ignore[attr-defined]  # as above
        name="EmberIngress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max_ongoing * (options.max_replicas or options.num_replicas),
    )
    return ingress.bind(replica.bind(engine_args, settings, max_waiting_requests), options.prefix_chars)


def app_builder(args: dict[str, Any]) -> Application:
    """For `serve run ember.integrations.ray_serve:app_builder model=... num_replicas=2` and a RayService's
    `serveConfigV2` (`import_path` and `args`): the same flags as the command line, as a mapping."""
    argv, _ = mapping_to_argv(make_parser(), args, "application args")
    engine_args, settings, options, ns = parse(argv)
    return build_application(engine_args, settings, options, ns.max_waiting_requests)
