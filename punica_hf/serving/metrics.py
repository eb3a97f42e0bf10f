"""Prometheus metrics of a serving engine, for ``GET /metrics``.

Counts and gauges are read from the engine (``Engine.stats()``) and the adapter store (``model.adapter_stats``)
when scraped; latencies are observed as each request finishes. Each ``ServingMetrics`` has its own registry, so
several servers in one process do not collide.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .engine import Completion, Engine

PREFIX = "punica"
# adapter_stats keys that only grow (exposed as counters); every other numeric key is a gauge
ADAPTER_COUNTERS = ("hits", "host_loads", "disk_loads", "evictions", "bytes_to_gpu")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServingMetrics:
    """The metrics of one engine; ``render()`` gives the Prometheus text and its content type."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Seconds from a request's arrival to its first token.",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            f"{PREFIX}_time_per_output_token_seconds", "Seconds between consecutive output tokens of a request.",
            buckets=TPOT_BUCKETS, registry=self.registry,
        )
        self.request_latency = Histogram(
            f"{PREFIX}_request_latency_seconds", "Seconds from a request's arrival to its end.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        engine.add_listener(self.observe)

    def observe(self, completion: Completion) -> None:
        """Record a finished request's latencies (called in the engine thread)."""
        if completion.time_to_first_token is not None:
            self.time_to_first_token.observe(completion.time_to_first_token)
        times = completion.token_times
        for previous, current in zip(times, times[1:]):
            if current > previous:  # tokens of one step arrive together: one gap per step
                self.time_per_output_token.observe(current - previous)
        self.request_latency.observe(completion.finished_at - completion.submitted_at)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    """Reads the engine's and the adapter store's numbers at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        requests = CounterMetricFamily(
            f"{PREFIX}_requests", "Finished requests by finish reason.", labels=["finish_reason"]
        )
        for reason, count in stats.finished.items():
            requests.add_metric([reason], count)
        yield requests
        for name, value, help_text in (
            ("requests_rejected", stats.rejected, "Requests refused because the queue was full."),
            ("requests_dropped_and_freed", stats.dropped_and_freed,
             "Requests dropped while running (cancelled, client disconnected, stop string), their KV blocks freed."),
            ("prompt_tokens", stats.prompt_tokens, "Prompt tokens of the requests that started."),
            ("generation_tokens", stats.generated_tokens, "Generated tokens."),
            ("engine_steps", stats.steps, "Batched forward passes."),
        ):
            yield CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=value)
        for name, value, help_text in (
            ("queue_length", stats.queued + stats.waiting, "Requests waiting to start."),
            ("running_requests", stats.running, "Requests holding KV cache blocks."),
            ("batch_requests", stats.last_batch_requests, "Requests in the last step's batch."),
            ("batch_tokens", stats.last_batch_tokens, "Tokens in the last step's batch."),
            ("kv_cache_free_fraction", stats.kv_free_fraction, "Free fraction of the paged KV cache."),
            ("cuda_graphs", stats.cuda_graphs, "Step shapes captured in CUDA graphs."),
        ):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)
        if self.engine.attention is not None:
            path = GaugeMetricFamily(f"{PREFIX}_attention_path", "The engine's attention path (1 for the one in use).",
                                     labels=["path"])
            path.add_metric([self.engine.attention.path], 1)
            yield path
        for key, value in self.engine.model.adapter_stats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key in ADAPTER_COUNTERS:
                yield CounterMetricFamily(f"{PREFIX}_adapter_{key}", f"Adapter store: {key}.", value=value)
            else:
                yield GaugeMetricFamily(f"{PREFIX}_adapter_{key}", f"Adapter store: {key}.", value=value)
