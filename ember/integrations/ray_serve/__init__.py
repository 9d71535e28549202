"""Ember replicas on Ray Serve (`pip install ember[ray]`): data parallelism across GPUs and machines.

`python -m ember.integrations.ray_serve --num-replicas 2 ...` starts N replicas (each an `AsyncLLM`
with Ember's own HTTP app, owning `--replica-gpus` GPUs or `--replica-cpus` cores) behind one
OpenAI-compatible ingress, with prefix-affinity routing (router.py) and optional autoscaling on
requests in flight; `app_builder` is the same application for `serve run` and KubeRay.
"""

from ember.integrations.ray_serve.app import (
    ReplicaOptions,
    add_replica_args,
    app_builder,
    build_application,
    make_parser,
    parse,
)

__all__ = ["ReplicaOptions", "add_replica_args", "app_builder", "build_application", "make_parser", "parse"]
