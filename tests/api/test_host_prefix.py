"""The app included by a host project under prefixes of its own (docs/django.md): its
metrics include serves the app's series, and the API answers JSON there too, misses
and unexpected errors included, while the host's other pages keep Django's own."""

from __future__ import annotations

import logging

import pytest
from django.core.signals import got_request_exception
from django.test import Client as DjangoClient
from django.test import override_settings
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from jobs.api.views import JobViewSet
from tests.api.conftest import new_client
from tests.api.test_json_errors import assert_json_error

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("host_urls")]

PREFIX = "/jobs/api/"
MISSES = ["", "v1/jobs/", "nope/", "jobs", "jobs/1", "jobs/abc/", "jobs/1.5/history/"]


@pytest.fixture
def host_urls(settings):
    """Through pytest-django's `settings`, which also takes the tests' DEBUG: one wrapper
    undoes both in order (a second one would restore the other's URLconf)."""
    settings.ROOT_URLCONF = "tests.api.host_urls"


@pytest.fixture
def token() -> str:
    return new_client("host-prefix")[1]


def web(token: str, **kwargs) -> DjangoClient:
    return DjangoClient(HTTP_AUTHORIZATION=f"Token {token}", **kwargs)


def scraped(body: str, name: str, labels: dict[str, str]) -> float:
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


@pytest.mark.django_db(transaction=True)  # counters move when the submission commits
def test_the_metrics_include_serves_the_apps_series(token):
    labels = {"queue": "default", "task": "echo"}
    before = scraped(
        DjangoClient().get("/jobs/metrics").content.decode(), "jobs_submitted_total", labels
    )
    r = web(token).post(f"{PREFIX}jobs/", {"task": "echo", "payload": {}}, "application/json")
    assert r.status_code == 201, r.content

    r = DjangoClient().get("/jobs/metrics")
    assert r.status_code == 200 and r["Content-Type"].startswith("text/plain"), r["Content-Type"]
    assert "no-cache" in r["Cache-Control"]
    assert scraped(r.content.decode(), "jobs_submitted_total", labels) == before + 1
    for family in text_string_to_metric_families(r.content.decode()):
        if family.name.startswith("jobs_"):
            for sample in family.samples:
                assert "job_id" not in sample.labels and "id" not in sample.labels, sample

    openmetrics = DjangoClient().get("/jobs/metrics", HTTP_ACCEPT="application/openmetrics-text")
    assert openmetrics["Content-Type"].startswith("application/openmetrics-text")
    assert openmetrics.content.rstrip().endswith(b"# EOF")
    assert DjangoClient().post("/jobs/metrics").status_code == 405


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("path", MISSES)
def test_a_miss_under_another_prefix_is_the_apis_json_404(settings, token, path, debug):
    settings.DEBUG = debug
    client = web(token, enforce_csrf_checks=True)
    for method in ("get", "post", "delete"):
        r = getattr(client, method)(PREFIX + path)
        assert_json_error(r, 404)
        assert r.json()["code"] == "not_found"
        assert "/jobs/api/schema/" in r.json()["detail"]  # the hint names the real prefix
    # The host's own pages keep Django's answer.
    assert not client.get("/nope/")["Content-Type"].startswith("application/json")


def test_an_unexpected_error_under_another_prefix_is_a_json_500_and_still_reported(
    monkeypatch, token, caplog
):
    def broken(self, request, pk):
        raise RuntimeError("a bug")

    monkeypatch.setattr(JobViewSet, "retrieve", broken)
    signalled = []

    def receiver(sender, request, **kwargs):
        signalled.append(request.path)

    got_request_exception.connect(receiver)
    try:
        with caplog.at_level(logging.ERROR, logger="django.request"):
            r = web(token, raise_request_exception=False).get(f"{PREFIX}jobs/1/")
    finally:
        got_request_exception.disconnect(receiver)
    assert_json_error(r, 500)
    assert r.json() == {"detail": "Internal server error.", "code": "server_error"}
    # Error trackers and logs learn of it as of any 500 Django answers itself.
    assert signalled == [f"{PREFIX}jobs/1/"]
    (record,) = [rec for rec in caplog.records if rec.name == "django.request"]
    assert record.exc_info and record.exc_info[0] is RuntimeError
    assert record.getMessage() == f"Internal Server Error: {PREFIX}jobs/1/"
    # A test client that re-raises view errors still sees it.
    with pytest.raises(RuntimeError, match="a bug"):
        web(token).get(f"{PREFIX}jobs/1/")
    # The host's own 500 page is Django's (its handler500), not the API's.
    with override_settings(DEBUG=True):
        r = web(token, raise_request_exception=False).get(f"{PREFIX}jobs/1/")
    assert r.status_code == 500 and r["Content-Type"].startswith("text/html")


def test_the_deployment_leaves_its_500s_to_django(monkeypatch, token):
    """Under the deployment's own /api/ nothing changes: Django's 500 path runs (its
    middleware sees the exception) and its handler500 answers in the API's shape."""

    def broken(self, request, pk):
        raise RuntimeError("a bug")

    monkeypatch.setattr(JobViewSet, "retrieve", broken)
    labels = {"type": "RuntimeError"}
    name = "django_http_exceptions_total_by_type_total"
    before = REGISTRY.get_sample_value(name, labels) or 0
    with override_settings(ROOT_URLCONF="jobservice.urls"):
        r = web(token, raise_request_exception=False).get("/api/v1/jobs/1/")
    assert_json_error(r, 500)
    assert REGISTRY.get_sample_value(name, labels) == before + 1
