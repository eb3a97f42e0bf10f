"""Prometheus metrics of a serving engine, for ``GET /metrics``.

Counts and gauges are read from the engine (``Engine.stats()``) and the adapter store (``model.adapter_stats``)
when scraped; latencies are observed as each request finishes. Each ``ServingMetrics`` has its own registry, so
several servers in one process do not collide.

Beside the ``punica_*`` metrics, the few that Kubernetes routers read from vLLM servers are exposed under vLLM's
names (``vllm:*``): the Gateway API Inference Extension (and llm-d, KServe, which use its endpoint picker) scores
pods by queue length, KV-cache usage and, for LoRA affinity, the adapters a pod is running or queueing and its
adapter limit (``vllm:lora_requests_info``, whose labels carry the data and whose value is a timestamp).
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .engine import Completion, Engine, RequestHandle

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
        self.in_flight = _InFlight()
        self.registry.register(_RouterCollector(engine, self.in_flight))
        engine.add_listener(self.observe)

    def track(self, handle: RequestHandle) -> None:
        """Count ``handle``'s adapter among the running or waiting ones until it finishes."""
        self.in_flight.add(handle)

    def observe(self, completion: Completion) -> None:
        """Record a finished request's latencies (called in the engine thread)."""
        self.in_flight.discard(completion.request_id)
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
            ("prefix_cache_hit_tokens", stats.prefix_hit_tokens,
             "Prompt tokens whose KV pages were shared from earlier requests of the same adapter (not computed)."),
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
            ("cuda_graphs", stats.cuda_graphs, "CUDA graphs captured (step shapes, with and without LoRA kernels)."),
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


class _InFlight:
    """The handles of the requests not finished yet (added from the event loop, removed in the engine thread)."""

    def __init__(self) -> None:
        self._handles: dict[str, RequestHandle] = {}
        self._lock = threading.Lock()

    def add(self, handle: RequestHandle) -> None:
        with self._lock:
            self._handles[handle.request_id] = handle
        if handle.done:  # it finished before it was added: its removal has come and gone
            self.discard(handle.request_id)

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._handles.pop(request_id, None)

    def adapters(self) -> tuple[set[str], set[str]]:
        """The adapters of the running requests (those that produced output) and of the waiting ones."""
        with self._lock:
            handles = [handle for handle in self._handles.values() if not handle.done]
        running = {h.adapter for h in handles if h.adapter is not None and h.started}
        waiting = {h.adapter for h in handles if h.adapter is not None and not h.started}
        return running, waiting


class _RouterCollector:
    """The vLLM-named metrics that Kubernetes LoRA-aware routers (the Gateway API Inference Extension) read."""

    def __init__(self, engine: Engine, in_flight: _InFlight) -> None:
        self.engine = engine
        self.in_flight = in_flight

    def collect(self):
        stats = self.engine.stats()
        kv_usage = 1.0 - stats.kv_free_fraction
        for name, value, help_text in (
            ("vllm:num_requests_waiting", stats.queued + stats.waiting, "Requests waiting to start."),
            ("vllm:num_requests_running", stats.running, "Requests holding KV cache blocks."),
            ("vllm:kv_cache_usage_perc", kv_usage, "Used fraction of the KV cache (1 is full)."),
            # the name before vLLM's v1 engine, still read by older endpoint pickers
            ("vllm:gpu_cache_usage_perc", kv_usage, "Used fraction of the KV cache (1 is full)."),
        ):
            yield GaugeMetricFamily(name, help_text, value=value)
        running, waiting = self.in_flight.adapters()
        info = GaugeMetricFamily(
            "vllm:lora_requests_info", "Adapters of the running and the waiting requests, comma-separated, and the "
            "most adapters on the device at once; the value is when this was read (Unix time).",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        info.add_metric([",".join(sorted(running)), ",".join(sorted(waiting)), str(self.engine.model.max_adapters)],
                        time.time())
        yield info
