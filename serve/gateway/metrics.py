"""Prometheus metrics: request latency histogram and request counter per route, model and status, and the
gateway's own share of each request (its overhead: the time it held the request, to the response's start, less
the time its backend calls took), as a histogram and as the `x-rtxserve-overhead-ms` header of every response.

A pure ASGI middleware (no BaseHTTPMiddleware overhead on the hot path). With several uvicorn
workers, set PROMETHEUS_MULTIPROC_DIR so that /metrics aggregates all of them.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import time
from contextvars import ContextVar
from pathlib import Path

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily

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
CALL_REQUESTS = Histogram(metric_names.CALL_REQUESTS, "Requests coalesced into one Triton call", ("model",),
                          buckets=(1, 2, 4, 8, 16, 32, 64, 128))
BACKEND_UP = Gauge(metric_names.BACKEND_UP, "1 when the replica answered its last health check", ("backend",),
                   multiprocess_mode="livemax")
BREAKER_OPEN = Gauge(metric_names.BREAKER_OPEN, "1 while the replica's circuit breaker keeps traffic away",
                     ("backend",), multiprocess_mode="livemax")
OVERHEAD_SECONDS = Histogram(metric_names.OVERHEAD_SECONDS, "The gateway's own time per request, backend calls left out",
                             ("route",), buckets=(0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.0075, 0.01,
                                                  0.025, 0.05, 0.1, 0.25, 1))
OVERHEAD_HEADER = metric_names.OVERHEAD_HEADER.encode()
# Seconds the request being served has waited on backends so far (state.py adds each call's).
BACKEND_WAIT: ContextVar[list[float]] = ContextVar("backend_wait")
ALIAS_REQUESTS = Counter(metric_names.ALIAS_REQUESTS, "Requests to a model alias, by the model drawn", ("alias", "model"))
FALLBACKS = Counter(metric_names.FALLBACKS, "Requests answered by a fallback model (no live replica of the model named)",
                    ("model", "fallback"))
AFFINITY = Counter(metric_names.AFFINITY, "Generation requests with a conversation key: on the replica it hashes to "
                   "(preferred) or, that one over its share of the load, on another (spilled)", ("outcome",))
QUOTA_STORAGE_ERRORS = Counter(metric_names.QUOTA_STORAGE_ERRORS, "Quota checks the quota storage (Redis) could not answer")
SHED = Counter(metric_names.SHED, "Model requests refused by admission control", ("reason",))
PRIORITY_QUEUED = Gauge(metric_names.PRIORITY_QUEUED, "Model requests waiting for a slot, by their key's priority",
                        ("priority",), multiprocess_mode="livesum")
PRIORITY_WAIT = Histogram(metric_names.PRIORITY_WAIT, "Seconds a request waited for a slot, by its key's priority",
                          ("priority",), buckets=BUCKETS)
PRIORITY_SHED = Counter(metric_names.PRIORITY_SHED, "Model requests refused by admission control, by their key's "
                        "priority", ("priority",))
MODEL_LOADS = Counter(metric_names.MODEL_LOADS, "Loads of on-demand models, by outcome", ("model", "outcome"))
MODEL_UNLOADS = Counter(metric_names.MODEL_UNLOADS, "Unloads of on-demand models: idle, or to make room", ("model", "reason"))
RESIDENCY_TAKEOVERS = Counter(metric_names.RESIDENCY_TAKEOVERS, "Times this gateway became the one that decides what "
                              "several gateways' on-demand models load and unload")
MODEL_LOAD_SECONDS = Histogram(metric_names.MODEL_LOAD_SECONDS, "Seconds an on-demand model took to load and answer its "
                               "first request", ("model",), buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
MODEL_UNLOAD_SECONDS = Histogram(metric_names.MODEL_UNLOAD_SECONDS, "Seconds an on-demand model took to unload (an "
                                 "engine: to stop or sleep)", ("model",),
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
MODEL_RESIDENT = Gauge(metric_names.MODEL_RESIDENT, "1 while an on-demand model is loaded", ("model",),
                       multiprocess_mode="livemax")
LOAD_WAITS = Counter(metric_names.LOAD_WAITS, "Requests that found their model unloaded and waited for its load, by "
                     "outcome (served, timeout: 503 after load_wait_s, failed: 503 naming the failure)", ("model", "outcome"))
ROLLOUT_SECONDS = Histogram(metric_names.ROLLOUT_SECONDS, "Backend time of the requests to a name under promotion, by "
                            "the model that answered and its role (current, candidate, shadow)",
                            ("model", "target", "role"), buckets=BUCKETS)
ROLLOUT_REQUESTS = Counter(metric_names.ROLLOUT_REQUESTS, "Requests to a name under promotion, by the model that answered, "
                           "its role and the outcome (ok, error; a shadow's: agree, disagree, ok, error)",
                           ("model", "target", "role", "outcome"))
BATCH_LINES = Counter(metric_names.BATCH_LINES, "Batch requests answered, by status code (0: not run, the batch "
                      "cancelled or expired)", ("status",))
ANSWER_CACHE_LOOKUPS = Counter(metric_names.ANSWER_CACHE_LOOKUPS, "Input rows of classify, embeddings and NER looked up in "
                               "the answer cache, by outcome (hit: answered from it)", ("model", "outcome"))
ANSWER_CACHE_EVICTIONS = Counter(metric_names.ANSWER_CACHE_EVICTIONS, "Rows the answer cache dropped to stay within its "
                                 "bytes", ("model",))
ANSWER_CACHE_BYTES = Gauge(metric_names.ANSWER_CACHE_BYTES, "Bytes the answer cache keeps", ("model",),
                           multiprocess_mode="livesum")
BATCHES = Counter(metric_names.BATCHES, "Batches ended, by how (completed, expired, cancelled, failed)", ("status",))
CAPACITY_RPS = Gauge(metric_names.CAPACITY_RPS, "The model's last confirmed capacity (rtxserve capacity --record)",
                     ("model", "stale"), multiprocess_mode="max")
CAPACITY_USED = Gauge(metric_names.CAPACITY_USED, "Requests/s of the last seconds over the model's confirmed capacity",
                      ("model", "stale"), multiprocess_mode="livesum")
# Requests by model, counted by the middleware for the headroom (fleet/headroom.py): a plain count, no lock
SEEN: collections.Counter[str] = collections.Counter()


def render(restarts_file: Path | None = None) -> tuple[bytes, str]:
    """Every series of this process (of every worker, with PROMETHEUS_MULTIPROC_DIR), and the box keeper's restarts
    where the settings name its file."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        body = generate_latest(registry)
    else:
        body = generate_latest()
    if restarts_file is not None:
        registry = CollectorRegistry()
        registry.register(Restarts(restarts_file))
        body += generate_latest(registry)
    return body, CONTENT_TYPE_LATEST


class Restarts:
    """The servers a `serve up` box's keeper (deploy/keeper.py) started again, read from its file at each scrape: the
    keeper restarts the gateway too, so the count lives with it, not in a gateway's memory."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def collect(self):
        family = CounterMetricFamily(metric_names.SERVER_RESTARTS, "Servers of the box started again after they died, "
                                     "by outcome (ok: answered ready; failed: did not start)", labels=("server", "outcome"))
        try:
            servers = json.loads(self.path.read_text()).get("servers", {})
        except (OSError, ValueError, AttributeError):  # no restart yet, or a file being replaced
            servers = {}
        for name, counts in sorted(servers.items()):
            family.add_metric([name, "ok"], counts.get("restarts", 0))
            family.add_metric([name, "failed"], counts.get("failures", 0))
        yield family


class MetricsMiddleware:
    """Times every HTTP request; the route is the matched path template (unmatched paths share one label)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500
        waited = [0.0]
        token = BACKEND_WAIT.set(waited)

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                overhead = time.perf_counter() - start - waited[0]
                _overhead(_route(scope)).observe(overhead)
                message["headers"] = [*message.get("headers", ()), (OVERHEAD_HEADER, b"%.3f" % (overhead * 1e3))]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            model = scope.get("state", {}).get("model", "")
            seconds, count = _request_series(_route(scope), model, status)
            seconds.observe(time.perf_counter() - start)
            count.inc()
            if model:
                SEEN[model] += 1
            BACKEND_WAIT.reset(token)


# A labelled series is looked up under a lock on every .labels() call: each request's are kept instead (a few
# routes x models x statuses).
@functools.lru_cache(maxsize=4096)
def _request_series(route: str, model: str, status: int):
    return REQUEST_SECONDS.labels(route, model, str(status)), REQUESTS.labels(route, model, str(status))


@functools.lru_cache(maxsize=256)
def _overhead(route: str):
    return OVERHEAD_SECONDS.labels(route)


def _route(scope) -> str:
    """The matched path template (set by the router once a route matched); unmatched paths share one label."""
    return getattr(scope.get("route"), "path", "unmatched")
