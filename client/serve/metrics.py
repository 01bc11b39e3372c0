"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own per server.

Names follow Prometheus' conventions (``_total`` counters, ``_seconds`` histograms, base units).
Session gauges are read from the runtime when scraped, so they are never stale.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

# Seconds: first tokens span a cached turn (milliseconds) to a cold long prompt (seconds).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_OVERHEAD_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)
# An ignored field's label: its name when it looks like a field name, among the first 64 seen.
_FIELD_LABEL = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,39}")
_MAX_FIELD_LABELS = 64


class ServerMetrics:
    """Every metric the server exports. Owner: the server's trio thread."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "muxworker_http_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.in_flight = Gauge("muxworker_http_requests_in_flight", "Generations being served now", registry=r)
        self.prompt_tokens = Counter("muxworker_prompt_tokens", "Prompt tokens of completed generations", registry=r)
        self.cached_tokens = Counter(
            "muxworker_cached_prompt_tokens",
            "Prompt tokens whose KV was reused (session history, a resumed file, or a prefix-cache entry)",
            registry=r,
        )
        self.completion_tokens = Counter("muxworker_completion_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "muxworker_time_to_first_token_seconds",
            "From the request's arrival to its first text (streamed or not)",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "muxworker_inter_token_seconds",
            "Between consecutive streamed text deltas",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.stream_overhead = Histogram(
            "muxworker_stream_overhead_seconds",
            "Server time per streamed delta: from the runtime handing it over to the bytes handed to the HTTP layer",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.saves = Counter("muxworker_session_saves", "Session saves to the store by result", ["result"], registry=r)
        self.resumes = Counter(
            "muxworker_session_resumes", "Sessions resumed from the store after a restart or on demand", registry=r
        )
        self.disconnects = Counter(
            "muxworker_client_disconnects", "Generations cancelled because their client went away", registry=r
        )
        self.worker_restarts = Counter(
            "muxworker_worker_restarts", "Times the worker died and was restarted", registry=r
        )
        self.reuse_copies = Counter(
            "muxworker_reuse_copies",
            "Shared rows copied into a session for a request that continues another",
            registry=r,
        )
        self.implicit_deletes = Counter(
            "muxworker_implicit_deletes", "Implicit sessions deleted past their store bound", registry=r
        )
        self.queued = Histogram(
            "muxworker_queue_wait_seconds",
            "Time a generation waited in the admission queue",
            buckets=(0.001, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60),
            registry=r,
        )
        self.sessions = Gauge("muxworker_sessions", "Sessions the server tracks, by state", ["state"], registry=r)
        self.worker_up = Gauge("muxworker_worker_up", "1 while the model worker is ready", registry=r)
        self.unknown_fields = Counter(
            "muxworker_unknown_fields",
            "Request fields the server does not know and ignored, by name (a new SDK field, a typo)",
            ["field"],
            registry=r,
        )
        self._unknown_labels: set[str] = set()

    def count_unknown_fields(self, names: Iterable[str]) -> None:
        """Count ignored request fields by name. The names are the clients' own, so the labels are
        bounded: a short identifier, and at most ``_MAX_FIELD_LABELS`` of them; the rest "other"."""
        for name in names:
            label = name if _FIELD_LABEL.fullmatch(name) else "other"
            if label not in self._unknown_labels:
                if len(self._unknown_labels) >= _MAX_FIELD_LABELS:
                    label = "other"
                self._unknown_labels.add(label)
            self.unknown_fields.labels(label).inc()

    def bind_sessions(self, stats: Callable[[], dict[str, int]]) -> None:
        """Read ``live`` and ``evicted`` from ``stats()`` at each scrape."""
        for state in ("live", "evicted"):
            self.sessions.labels(state).set_function(_reader(stats, state))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _reader(stats: Callable[[], dict[str, int]], key: str) -> Callable[[], float]:
    return lambda: float(stats().get(key, 0))
