"""The gateway's Prometheus metric names, declared once: the gateway exports them (serve/gateway/metrics.py), the
rendered dashboards and alerts query them (deploy/monitoring.py) and the load tester scrapes them
(loadtest/server_metrics.py)."""

REQUEST_SECONDS = "rtxserve_request_duration_seconds"  # histogram, by route, model, status
REQUESTS = "rtxserve_requests_total"  # counter, by route, model, status
TOKENS = "rtxserve_tokens_total"  # counter, by model, kind
IN_FLIGHT = "rtxserve_requests_in_flight"  # gauge
QUEUED = "rtxserve_requests_queued"  # gauge
SHED = "rtxserve_requests_shed_total"  # counter, by reason
BACKEND_SECONDS = "rtxserve_backend_request_duration_seconds"  # histogram, by backend
BACKEND_UP = "rtxserve_backend_up"  # gauge, by backend
BREAKER_OPEN = "rtxserve_backend_breaker_open"  # gauge, by backend
