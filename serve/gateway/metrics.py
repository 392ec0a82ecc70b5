"""Prometheus metrics: request latency histogram and request counter per route, model and status.

A pure ASGI middleware (no BaseHTTPMiddleware overhead on the hot path). With several uvicorn
workers, set PROMETHEUS_MULTIPROC_DIR so that /metrics aggregates all of them.
"""

from __future__ import annotations

import os
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from core import metric_names

BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)
LABELS = ("route", "model", "status")
REQUEST_SECONDS = Histogram(metric_names.REQUEST_SECONDS, "Gateway request latency", LABELS, buckets=BUCKETS)
REQUESTS = Counter(metric_names.REQUESTS, "Gateway requests by final status", LABELS)
TOKENS = Counter(metric_names.TOKENS, "Tokens processed by generation models", ("model", "kind"))
# livesum: with several workers, /metrics shows the sum over the live ones.
IN_FLIGHT = Gauge(metric_names.IN_FLIGHT, "Model requests being served", multiprocess_mode="livesum")
QUEUED = Gauge(metric_names.QUEUED, "Model requests waiting for a slot", multiprocess_mode="livesum")
BACKEND_SECONDS = Histogram(metric_names.BACKEND_SECONDS, "Time a backend replica took per call",
                            ("backend",), buckets=BUCKETS)
BACKEND_UP = Gauge(metric_names.BACKEND_UP, "1 when the replica answered its last health check", ("backend",),
                   multiprocess_mode="livemax")
BREAKER_OPEN = Gauge(metric_names.BREAKER_OPEN, "1 while the replica's circuit breaker keeps traffic away",
                     ("backend",), multiprocess_mode="livemax")
SHED = Counter(metric_names.SHED, "Model requests refused by admission control", ("reason",))


def render() -> tuple[bytes, str]:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Times every HTTP request; the route is the matched path template (unmatched paths share one label)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            matched = scope.get("route")  # set by the router once a route matched
            route = getattr(matched, "path", "unmatched")
            model = scope.get("state", {}).get("model", "")
            labels = (route, model, str(status))
            REQUEST_SECONDS.labels(*labels).observe(time.perf_counter() - start)
            REQUESTS.labels(*labels).inc()
