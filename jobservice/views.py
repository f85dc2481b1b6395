"""The deployment's front page: the URL `make run` prints answers with where to go."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join

LINKS = (
    ("admin:index", "Admin", "jobs, queues, schedules, workflows, webhooks (staff login)"),
    ("api-docs", "API docs", "Swagger UI of /api/v1/ (calls need a client token)"),
    ("api-schema", "OpenAPI schema", "the document the docs page shows"),
    ("healthz", "healthz", "liveness"),
    ("readyz", "readyz", "PostgreSQL and Redis reachable"),
)


def home(request: HttpRequest) -> HttpResponse:
    items = format_html_join(
        "\n", '<li><a href="{}">{}</a>: {}</li>', ((reverse(n), t, d) for n, t, d in LINKS)
    )
    return HttpResponse(
        format_html(
            '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>jobservice'
            "</title></head><body><h1>jobservice</h1><ul>\n{}\n</ul>"
            '<p>Metrics: <a href="/metrics">/metrics</a> (workers and the reaper serve '
            "their own).</p></body></html>",
            items,
        )
    )
