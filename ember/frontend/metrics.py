"""Engine metrics in Prometheus form, named like vLLM's (`vllm:` becomes `ember:`) so dashboards carry over.

Two sources feed them: the engine core's `SchedulerStats` (queue lengths, KV usage, prefix cache,
preemptions; sent with every step) and the front end's `IterationStats` (tokens, latencies and
finished requests, derived from the core's outputs). Latencies use the core's step timestamps
against the front end's arrival times: both are `time.monotonic()`, one clock per machine, so
they do not depend on how a client reads its stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ember.messages import SchedulerStats, SpecDecodeStats

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)


@dataclass
class IterationStats:
    """What one batch of core outputs (or a front-end abort) meant for the metrics."""

    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0  # of requests that got their first token
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    finished: list[tuple[str, float]] = field(default_factory=list)  # (finish reason, seconds since arrival)


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.running = gauge("ember:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("ember:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("ember:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        self.prefix_queries = counter("ember:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("ember:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("ember:num_preemptions", "Requests preempted for lack of KV blocks.")
        self.encoded_images = counter(
            "ember:mm_encoder_images", "Images run through the vision tower (a cached image's output is reused)."
        )
        self.prompt_tokens = counter("ember:prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("ember:generation_tokens", "Generated tokens.")
        self.ttft = histogram("ember:time_to_first_token_seconds", "Arrival to first generated token.")
        self.itl = histogram("ember:inter_token_latency_seconds", "Time between consecutive generated tokens.")
        self.e2e = histogram("ember:e2e_request_latency_seconds", "Arrival to the end of the request.")
        self.content_filtered = counter(
            "ember:request_content_filtered", "Sequences ended before a blocked phrase (--blocked-words)."
        )
        self._success = Counter(
            "ember:request_success", "Finished requests by finish reason.", labels + ["finished_reason"], registry=r
        )
        self.model_name = model_name
        self._seen = (0, 0, 0, 0)
        self._spec: _SpecCounters | None = None  # made with the first speculative stats: none without

    def record_scheduler(self, s: SchedulerStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        queries, hits, preempted, encoded = self._seen
        self.prefix_queries.inc(s.prefix_cache_queries - queries)
        self.prefix_hits.inc(s.prefix_cache_hits - hits)
        self.preemptions.inc(s.num_preemptions - preempted)
        self.encoded_images.inc(s.num_encoded_images - encoded)
        self._seen = (s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions, s.num_encoded_images)
        if s.spec_decode is not None:
            self._record_spec(s.spec_decode)

    def _record_spec(self, spec: SpecDecodeStats) -> None:
        if self._spec is None:
            self._spec = _SpecCounters(self.registry, self.model_name)
        self._spec.record(spec)

    def record_iteration(self, it: IterationStats) -> None:
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        for value in it.ttfts:
            self.ttft.observe(value)
        for value in it.itls:
            self.itl.observe(value)
        for reason, e2e in it.finished:
            self.e2e.observe(e2e)
            self._success.labels(self.model_name, reason).inc()
            if reason == "content_filter":
                self.content_filtered.inc()


class _SpecCounters:
    """Speculative decoding's counters (vLLM's spec_decode metrics), fed the core's running totals."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.model_name = model_name
        self.drafts = Counter(
            "ember:spec_decode_num_drafts",
            "Draft runs verified (a request's drafts in one step).",
            labels,
            registry=registry,
        ).labels(model_name)
        self.draft_tokens = Counter(
            "ember:spec_decode_num_draft_tokens", "Draft tokens verified.", labels, registry=registry
        ).labels(model_name)
        self.accepted = Counter(
            "ember:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels, registry=registry
        ).labels(model_name)
        self.per_pos = Counter(
            "ember:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            labels + ["position"],
            registry=registry,
        )
        self.seen = SpecDecodeStats(0, 0, 0, [])

    def record(self, spec: SpecDecodeStats) -> None:
        seen = self.seen
        self.drafts.inc(spec.num_drafts - seen.num_drafts)
        self.draft_tokens.inc(spec.num_draft_tokens - seen.num_draft_tokens)
        self.accepted.inc(spec.num_accepted_tokens - seen.num_accepted_tokens)
        before = seen.num_accepted_tokens_per_pos + [0] * len(spec.num_accepted_tokens_per_pos)
        for pos, count in enumerate(spec.num_accepted_tokens_per_pos):
            self.per_pos.labels(self.model_name, str(pos)).inc(count - before[pos])
        self.seen = spec
