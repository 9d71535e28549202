"""Engine metrics in Prometheus form, named like vLLM's (`vllm:` becomes `ember:`) so dashboards carry over.

The engine hands a `StepStats` snapshot to its stat loggers after every step; latencies are
measured from the engine's own clock, so they do not depend on how a client reads its stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ember.engine.request import Request

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass
class StepStats:
    now: float
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    num_preemptions: int  # cumulative
    sampled: list[Request]  # requests that got one new token this step
    finished: list[Request]  # requests that ended this step (including aborts)


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("ember:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("ember:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("ember:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        self.prefix_queries = counter("ember:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("ember:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("ember:num_preemptions", "Requests preempted for lack of KV blocks.")
        self.prompt_tokens = counter("ember:prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("ember:generation_tokens", "Generated tokens.")
        self.ttft = histogram("ember:time_to_first_token_seconds", "Arrival to first generated token.")
        self.itl = histogram("ember:inter_token_latency_seconds", "Time between consecutive generated tokens.")
        self.e2e = histogram("ember:e2e_request_latency_seconds", "Arrival to the end of the request.")
        self._success = Counter("ember:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.model_name = model_name
        self._last_token_time: dict[str, float] = {}
        self._seen = (0, 0, 0)

    def __call__(self, s: StepStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        queries, hits, preempted = self._seen
        self.prefix_queries.inc(s.prefix_cache_queries - queries)
        self.prefix_hits.inc(s.prefix_cache_hits - hits)
        self.preemptions.inc(s.num_preemptions - preempted)
        self._seen = (s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions)
        for req in s.sampled:
            last = self._last_token_time.get(req.request_id)
            if last is None:
                self.ttft.observe(s.now - req.arrival_time)
                self.prompt_tokens.inc(req.num_prompt_tokens)
            else:
                self.itl.observe(s.now - last)
            self._last_token_time[req.request_id] = s.now
        self.generation_tokens.inc(len(s.sampled))
        for req in s.finished:
            self._last_token_time.pop(req.request_id, None)
            self.e2e.observe(s.now - req.arrival_time)
            self._success.labels(self.model_name, req.status.value).inc()
