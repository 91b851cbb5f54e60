"""Prometheus metrics fed from the engine's event bus."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jitney.core import events as ev
from jitney.core.hooks import hookimpl

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class PrometheusMetrics:
    """An observer plugin: turns each step's events into Prometheus series on its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.ttft = Histogram("jitney_time_to_first_token_seconds", "Queueing to first token", buckets=_LATENCY, registry=r)
        self.itl = Histogram("jitney_inter_token_latency_seconds", "Between consecutive tokens of a request", buckets=_LATENCY, registry=r)
        self.e2e = Histogram("jitney_request_latency_seconds", "Queueing to finish", buckets=_LATENCY, registry=r)
        self.queue = Histogram("jitney_queue_time_seconds", "Queueing to prefill start", buckets=_LATENCY, registry=r)
        self.running = Gauge("jitney_requests_running", "Requests holding cache", registry=r)
        self.waiting = Gauge("jitney_requests_waiting", "Requests waiting to start", registry=r)
        self.kv_usage = Gauge("jitney_kv_cache_usage_ratio", "Share of KV blocks in use", registry=r)
        self.preemptions = Counter("jitney_preemptions", "Requests offloaded or soft reset", registry=r)
        self.prefix_queries = Counter("jitney_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("jitney_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", registry=r)
        self.prompt_tokens = Counter("jitney_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated = Counter("jitney_generation_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("jitney_draft_tokens", "Tokens proposed by the speculative draft", registry=r)
        self.accepted = Counter("jitney_draft_accepted_tokens", "Proposed tokens the model agreed with", registry=r)
        self.finished = Counter("jitney_requests_finished", "Finished requests", ["reason"], registry=r)
        self._queued: dict[str, float] = {}
        self._last: dict[str, float] = {}

    @hookimpl
    def jitney_on_events(self, events, engine):
        for e in events:
            if isinstance(e, ev.TokensGenerated):
                last = self._last.get(e.request_id)
                if last is not None:
                    self.itl.observe(e.t - last)
                self._last[e.request_id] = e.t
                self.generated.inc(e.tokens)
            elif isinstance(e, ev.StepCompleted):
                self.preemptions.inc(e.preemptions)
                self.prefix_queries.inc(e.prefix_query_tokens)
                self.prefix_hits.inc(e.prefix_hit_tokens)
                if e.draft_tokens:
                    self.drafted.inc(e.draft_tokens)
                    self.accepted.inc(e.accepted_tokens)
            elif isinstance(e, ev.RequestQueued):
                self._queued[e.request_id] = e.t
            elif isinstance(e, ev.PrefillStarted):
                queued = self._queued.pop(e.request_id, None)
                if queued is not None:
                    self.queue.observe(e.t - queued)
            elif isinstance(e, ev.FirstToken):
                self.ttft.observe(e.ttft)
            elif isinstance(e, ev.RequestFinished):
                self.e2e.observe(e.latency)
                self.prompt_tokens.inc(e.prompt_tokens)
                self.finished.labels(e.finish_reason).inc()
                self._last.pop(e.request_id, None)
                self._queued.pop(e.request_id, None)
        if engine is not None:  # (requests also end between steps, aborted: the gauges follow them there too)
            cache = engine.cache
            self.running.set(len(engine.active))
            self.waiting.set(len(engine.waiting))
            self.kv_usage.set(1 - cache.num_free_blocks / cache.num_blocks)

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)
