"""Optional OpenTelemetry tracing: with `otlp_endpoint` set (RTXSERVE_OTLP_ENDPOINT, e.g.
http://collector:4318/v1/traces) every model request becomes a span, exported over OTLP/HTTP; the
backend calls made inside it are child spans. Probes and metrics are not traced. Needs the `otel` extra
(`pip install 'rtxserve[otel]'`)."""

from __future__ import annotations

UNTRACED = "healthz,health,readyz,metrics"


def install_tracing(app, endpoint: str = "", *, processor=None, service_name: str = "rtxserve-gateway"):
    """Instrument `app`; spans go to `processor` (default: batched OTLP/HTTP export to `endpoint`)."""
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError("tracing needs the otel extra: pip install 'rtxserve[otel]'") from exc
    if processor is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(processor)
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, excluded_urls=UNTRACED)
    return provider
