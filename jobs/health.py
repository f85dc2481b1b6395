"""Liveness and readiness probes (SPEC §9)."""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, JsonResponse

from jobs import transport


def healthz(request: HttpRequest) -> JsonResponse:
    """The process is alive; touches nothing else."""
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> JsonResponse:
    """Ready when Postgres answers. Redis is reported, not required: without it
    jobs are still accepted (as enqueue_failed) and workers poll Postgres."""
    try:
        with connection.cursor() as cur:
            cur.execute("SELECT 1")
        postgres = "ok"
    except Exception as exc:  # any database failure means not ready
        postgres = f"error: {exc.__class__.__name__}"
    redis_state = transport.get_transport().state()
    ready = postgres == "ok"
    return JsonResponse(
        {"status": "ok" if ready else "unavailable", "postgres": postgres, "redis": redis_state},
        status=200 if ready else 503,
    )
