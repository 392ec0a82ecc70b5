"""Optional OpenTelemetry tracing: a span per model request, none for probes."""

from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serve.gateway.app import create_app
from serve.gateway.edge.otel import install_tracing
from serve.gateway.settings import GatewaySettings


def test_model_requests_are_traced_and_probes_are_not(backend):
    app = create_app(GatewaySettings(health_interval_s=60), [backend])
    spans = InMemorySpanExporter()
    install_tracing(app, processor=SimpleSpanProcessor(spans))
    with TestClient(app) as client:
        assert client.post("/v1/classify", json={"model": "clf", "input": "good"}).status_code == 200
        assert client.get("/healthz").status_code == 200
    names = [s.name for s in spans.get_finished_spans()]
    assert "POST /v1/classify" in names and not any("healthz" in n for n in names)
    server = next(s for s in spans.get_finished_spans() if s.name == "POST /v1/classify")
    assert server.attributes.get("http.response.status_code", server.attributes.get("http.status_code")) == 200
