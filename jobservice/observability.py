"""The deployment's traces and error reports, from the standard environment variables
(docs/observability.md): the OpenTelemetry SDK when an exporter is asked for (OTEL_*),
the Sentry client when SENTRY_DSN is set. A host project configures its own instead."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

SERVICE_NAME = "jobservice"


def tracing_wanted(environ: Mapping[str, str]) -> bool:
    """OTEL_TRACES_EXPORTER names an exporter, or an OTLP endpoint is set."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if exporters:
        return exporters != "none"
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def _missing(extra: str, distribution: str) -> RuntimeError:
    return RuntimeError(f"{distribution} is not installed: pip install 'jobservice[{extra}]'")


def configure_tracing(environ: Mapping[str, str] = os.environ) -> bool:
    """The global tracer provider with a batch processor per exporter of
    OTEL_TRACES_EXPORTER (otlp: OTLP/HTTP, console); the exporter, the batching and the
    resource read their own OTEL_* variables."""
    if not tracing_wanted(environ):
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        raise _missing("otel", "opentelemetry-sdk") from None
    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    for name in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(","):
        name = name.strip()
        exporter: Any
        if name == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError:
                raise _missing("otel", "opentelemetry-exporter-otlp-proto-http") from None
            exporter = OTLPSpanExporter()
        elif name == "console":
            exporter = ConsoleSpanExporter()
        else:
            raise RuntimeError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (otlp, console)")
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return True


def configure_sentry(environ: Mapping[str, str] = os.environ) -> bool:
    """sentry-sdk with its Django integration when SENTRY_DSN is set (SENTRY_ENVIRONMENT
    and SENTRY_RELEASE are the client's own variables)."""
    if not environ.get("SENTRY_DSN"):
        return False
    try:
        import sentry_sdk
        from sentry_sdk.integrations.django import DjangoIntegration
    except ImportError:
        raise _missing("sentry", "sentry-sdk") from None
    sentry_sdk.init(dsn=environ["SENTRY_DSN"], integrations=[DjangoIntegration()])
    return True


def wsgi(app: Any) -> Any:
    """The API's WSGI application inside a server span per request when tracing is on
    (the fast lane's requests too); otherwise a request's `traceparent` is kept as it
    came, for the job it submits."""
    from jobs.observability import tracing

    if tracing.tracer() is not None:
        from opentelemetry.instrumentation.wsgi import OpenTelemetryMiddleware

        return OpenTelemetryMiddleware(app)
    return PassThrough(app)


class PassThrough:
    def __init__(self, app: Any) -> None:
        from jobs.observability import tracing

        self.app = app
        self.tracing = tracing

    def __call__(self, environ: dict, start_response: Any) -> Any:
        parent = environ.get("HTTP_TRACEPARENT")
        if parent is None:
            return self.app(environ, start_response)
        token = self.tracing.incoming(parent, environ.get("HTTP_TRACESTATE"))
        try:
            return self.app(environ, start_response)
        finally:
            self.tracing.release(token)
