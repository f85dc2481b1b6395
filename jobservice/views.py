"""The deployment's front page: the URL `make run` prints answers with where to go
(templates/home.html)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse

LINKS = (
    ("admin:index", "Admin", "jobs, queues, schedules, workflows, webhooks (staff login)"),
    ("api-docs", "API docs", "Swagger UI of /api/v1/ (calls need a client token)"),
    ("api-schema", "OpenAPI schema", "the document the docs page shows"),
    ("healthz", "healthz", "liveness"),
    ("readyz", "readyz", "PostgreSQL and Redis reachable"),
)


def home(request: HttpRequest) -> HttpResponse:
    links = [{"href": reverse(n), "title": t, "description": d} for n, t, d in LINKS]
    return render(request, "home.html", {"links": links})
