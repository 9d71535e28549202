"""Ray Serve replicas (ember.integrations.ray_serve): 2 CPU replicas against 1, each with 1 core.

Three runs of one workload on a local Ray cluster: 1 replica; 2 replicas with prefix-affinity
routing; 2 replicas routed to the least-loaded one (`--no-prefix-routing`). The workload is
`--groups` groups of `--per-group` prompts; the prompts of a group share a `--prefix-chars`-character
prefix (a system prompt) and differ after it; they are sent shuffled, `--concurrency` at a time,
`--output-len` greedy tokens each. Reported per run: output tokens/s, the ratio to 1 replica, and
the prefix-cache hit rate (prompt tokens found in the cache / prompt tokens looked up, summed over
the replicas' own `ember:prefix_cache_*` counters, each read through the ingress pinned to it).

    python benchmarks/ray_replicas.py                                              # the issue's target
    python benchmarks/ray_replicas.py --groups 2 --per-group 2 --output-len 4 --concurrency 2   # quick

Each replica's torch runs one thread (Ray sets OMP_NUM_THREADS to an actor's `num_cpus`, and the
engine core process inherits it); run it on a machine with at least 3 idle cores (two replicas plus
Ray's HTTP proxy and Ember's ingress). Needs `pip install -e .[ray]`. Writes
benchmarks/results/ray-replicas-<model>-<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from typing import Any

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray
from ray import serve

from benchmarks.common import RESULTS_DIR, free_port, machine_info, today, write_json
from benchmarks.throughput import model_short_name
from ember.http_client import error_message, http_request
from ember.integrations.ray_serve import build_application, parse
from ember.integrations.ray_serve.replica import REPLICA_HEADER

RUNS = {"1 replica": (1, True), "2 replicas, prefix routing": (2, True), "2 replicas, least loaded": (2, False)}
_WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
]


def make_prompts(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    prompts = []
    for g in range(args.groups):
        prefix = f"System {g}: " + " ".join(rng.choice(_WORDS) for _ in range(args.prefix_chars))
        prefix = prefix[: args.prefix_chars]
        prompts += [f"{prefix}\nQuestion {i}: {' '.join(rng.choices(_WORDS, k=8))}?" for i in range(args.per_group)]
    rng.shuffle(prompts)
    return prompts


async def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[dict, str]:
    response = await http_request("POST", url, body, headers)
    try:
        data = await response.read()
    finally:
        await response.close()
    if response.status != 200:
        raise RuntimeError(f"{url}: {response.status} {error_message(data)}")
    return json.loads(data), response.headers[REPLICA_HEADER]


async def _prefix_counters(url: str, replica: str) -> tuple[float, float]:
    response = await http_request("GET", url + "/metrics", headers={REPLICA_HEADER: replica})
    try:
        text = (await response.read()).decode()
    finally:
        await response.close()
    if response.headers.get(REPLICA_HEADER) != replica:
        raise RuntimeError(f"replica {replica} did not answer its /metrics")

    def value(name: str) -> float:
        return float(re.search(rf"^ember:{name}_total\{{[^}}]*\}} (\S+)$", text, re.MULTILINE).group(1))

    return value("prefix_cache_hits"), value("prefix_cache_queries")


async def run_workload(url: str, args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    gate = asyncio.Semaphore(args.concurrency)
    seen: dict[str, int] = {}

    async def one(prompt: str) -> int:
        async with gate:
            data, replica = await _post(
                url + "/v1/completions",
                {
                    "model": "ember",
                    "prompt": prompt,
                    "max_tokens": args.output_len,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
        seen[replica] = seen.get(replica, 0) + 1
        return data["usage"]["completion_tokens"]

    await one("Warm-up: hello")
    # Counters start at zero with each run's fresh replicas; only the warm-up's must be taken off.
    before = {replica: await _prefix_counters(url, replica) for replica in seen}
    seen.clear()
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    elapsed = time.perf_counter() - start
    hits = queries = 0.0
    for replica in seen:
        (h, q), (h0, q0) = await _prefix_counters(url, replica), before.get(replica, (0.0, 0.0))
        hits, queries = hits + h - h0, queries + q - q0
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "output_tok_s": tokens / elapsed,
        "requests_per_replica": sorted(seen.values(), reverse=True),
        "prefix_hit_rate": hits / queries if queries else 0.0,
    }


def serve_run(args: argparse.Namespace, replicas: int, prefix_routing: bool) -> None:
    flags = [
        *([args.model] if args.model else []),
        "--served-model-name",
        "ember",
        "--device",
        "cpu",
        "--kv-cache-memory",
        str(args.kv_cache_memory),
        "--max-model-len",
        str(args.max_model_len),
        "--num-replicas",
        str(replicas),
        "--replica-cpus",
        "1",
        "--prefix-routing" if prefix_routing else "--no-prefix-routing",
    ]
    engine_args, settings, options, _ = parse(flags)
    serve.run(build_application(engine_args, settings, options), name="ember", route_prefix="/")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the default model)")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--prefix-chars", type=int, default=1500, help="characters of each group's shared prefix")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB per replica")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="JSON path (default: benchmarks/results/...)")
    args = parser.parse_args()

    machine = machine_info()
    prompts = make_prompts(args)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results: dict[str, Any] = {}
    try:
        port = free_port("127.0.0.1")
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name, (replicas, prefix_routing) in RUNS.items():
            serve_run(args, replicas, prefix_routing)
            results[name] = asyncio.run(run_workload(f"http://127.0.0.1:{port}", args, prompts))
            serve.delete("ember")
    finally:
        serve.shutdown()
        ray.shutdown()
    base = results["1 replica"]["output_tok_s"]
    print(f"{'run':<28} {'tok/s':>8} {'vs 1':>6} {'prefix hit':>10}  requests per replica")
    for name, r in results.items():
        r["ratio_to_1_replica"] = r["output_tok_s"] / base
        print(
            f"{name:<28} {r['output_tok_s']:>8.1f} {r['ratio_to_1_replica']:>6.2f} "
            f"{r['prefix_hit_rate']:>10.1%}  {r['requests_per_replica']}"
        )
    model = model_short_name(args.model)
    path = args.output or os.path.join(RESULTS_DIR, f"ray-replicas-{model}-{today()}.json")
    write_json(
        path,
        {
            "benchmark": "ray_replicas",
            "date": today(),
            "machine": machine,
            "model": model,
            "config": vars(args),
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
