"""Prometheus metrics of the HTTP server (prometheus-client, one registry per server).

Per-request counters and latency histograms are observed in the tokenizer manager, where a request
starts and ends (SGLang does the same). Scheduler-side facts (evictions, retractions, queue sizes, KV
usage) are read from the scheduler's latest internal state when /metrics is scraped, so they are the
scheduler's own monotonic counters, never re-counted here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "radixserve:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                    3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)

# Scheduler state key -> (metric name without prefix, help). Counters end in _total on exposition.
SCHEDULER_COUNTERS = {
    "evicted_tokens": ("evicted_tokens", "KV tokens evicted from the radix cache"),
    "num_retractions": ("num_retractions", "requests retracted from decode because the KV pool was full"),
    "spec_verify_steps": ("spec_verify_steps", "speculative decoding: request steps that verified a draft"),
    "spec_draft_tokens": ("spec_draft_tokens", "speculative decoding: draft tokens verified"),
    "spec_accepted_tokens": ("spec_accepted_tokens", "speculative decoding: draft tokens accepted"),
    "hicache_loaded_tokens": ("hicache_loaded_tokens", "prompt tokens whose KV was loaded from the disk tier"),
    "hicache_storage_hits": ("hicache_storage_hits", "disk tier: pages read and verified"),
    "hicache_storage_misses": ("hicache_storage_misses", "disk tier: pages looked for and not found or corrupt"),
    "hicache_bytes_written": ("hicache_bytes_written", "disk tier: KV bytes written"),
    "hicache_bytes_read": ("hicache_bytes_read", "disk tier: KV bytes read"),
    "hicache_corrupt_pages": ("hicache_corrupt_pages", "disk tier: pages that failed their checksum (deleted)"),
    "hicache_host_loaded_tokens": ("hicache_host_loaded_tokens", "prompt tokens whose KV was loaded from the host "
                                                                 "tier"),
    "hicache_storage_loaded_tokens": ("hicache_storage_loaded_tokens", "prompt tokens whose KV was loaded from the "
                                                                       "storage backend"),
    "hicache_host_hits": ("hicache_host_hits", "host tier: pages found"),
    "hicache_host_misses": ("hicache_host_misses", "host tier: pages looked for and absent"),
    "hicache_load_seconds": ("hicache_load_seconds", "hierarchical cache: seconds loading pages into the KV pool"),
    "hicache_store_seconds": ("hicache_store_seconds", "hierarchical cache: seconds storing pages (host + storage)"),
}
SCHEDULER_GAUGES = {
    "num_running_reqs": ("num_running_reqs", "requests in the running (decode) batch"),
    "num_waiting_reqs": ("num_queue_reqs", "requests waiting to be scheduled"),
    "token_usage": ("token_usage", "fraction of the KV pool held by requests and locked cache (not evictable)"),
    "evictable_tokens": ("evictable_tokens", "KV tokens in the radix cache that could be evicted"),
    "max_total_num_tokens": ("max_total_num_tokens", "KV pool size in tokens"),
    "hicache_host_usage_bytes": ("hicache_host_usage_bytes", "host tier: bytes of KV pages held"),
    "spec_accept_rate": ("spec_accept_rate", "speculative decoding: accepted / verified draft tokens, since start"),
    "spec_accept_length": ("spec_accept_length", "speculative decoding: tokens a request's verify step yielded, "
                                                 "on average since start (accepted drafts + the model's own)"),
}


class ServerMetrics:
    """All metrics of one server; `expose()` renders the Prometheus text format."""

    def __init__(self, scheduler_state: Callable[[], dict[str, Any]], scheduler_up: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of finished or aborted requests",
                                     registry=r)
        self.cached_tokens = Counter(PREFIX + "cached_tokens", "prompt tokens served from the radix cache",
                                     registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "tokens generated and delivered",
                                         registry=r)
        self.num_requests = Counter(PREFIX + "num_requests", "requests that ended (any reason)", registry=r)
        self.num_aborted = Counter(PREFIX + "num_aborted_requests",
                                   "requests aborted: client disconnects, scheduler aborts and failures",
                                   registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "time between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "request latency, arrival to end",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_SchedulerCollector(scheduler_state, scheduler_up))

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_tokens(self, num_tokens: int, seconds_since_last: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if seconds_since_last is not None and num_tokens > 0:
            per_token = seconds_since_last / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(per_token)

    def observe_finished(self, prompt_tokens: int, cached_tokens: int, e2e_seconds: float, aborted: bool) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.num_requests.inc()
        self.e2e.observe(e2e_seconds)
        if aborted:
            self.num_aborted.inc()

    def expose(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCollector:
    def __init__(self, state: Callable[[], dict[str, Any]], up: Callable[[], bool]) -> None:
        self._state = state
        self._up = up

    def collect(self) -> Iterator[Metric]:
        state = self._state() or {}
        yield GaugeMetricFamily(PREFIX + "scheduler_up", "1 while the scheduler process answers",
                                value=1.0 if self._up() else 0.0)
        for key, (name, doc) in SCHEDULER_COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=float(state.get(key, 0) or 0))
        for key, (name, doc) in SCHEDULER_GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(state.get(key, 0) or 0))
