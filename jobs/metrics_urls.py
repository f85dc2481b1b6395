"""The API process's Prometheus metrics as an opt-in include:
`path("jobs/metrics", include("jobs.metrics_urls"))`.

Workers and reapers serve their own (`--metrics-port`); this is for the web process,
which counts submissions, refusals and staff actions (jobs.metrics). Like the
deployment's `/metrics` it asks for no credentials, so mount it where only Prometheus
reaches it. Under a multi-process server (PROMETHEUS_MULTIPROC_DIR set, as gunicorn.conf.py
does) it sums every process's files, as django-prometheus's view does.
"""

from __future__ import annotations

import os

from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe
from prometheus_client import REGISTRY, CollectorRegistry, multiprocess
from prometheus_client.exposition import choose_encoder

from jobs import metrics as _series  # noqa: F401  (the app's series, listed from the first scrape)


def _registry() -> CollectorRegistry:
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    return REGISTRY


@require_safe
@never_cache  # a scrape is a reading of now, never a proxy's copy
def metrics(request: HttpRequest) -> HttpResponse:
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(_registry()), content_type=content_type)


urlpatterns = [path("", metrics, name="jobs-metrics")]
