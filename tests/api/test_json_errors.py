"""Every answer under /api/ is JSON in the API's error shape: misses (404), wrong
methods (405) and unexpected errors (500) included, with DEBUG on or off."""

from __future__ import annotations

import re

import pytest
import yaml

from jobs.api.views import JobViewSet
from tests.api.conftest import authed, new_client

pytestmark = pytest.mark.django_db

METHODS = ("get", "post", "put", "patch", "delete")

MISSES = [
    "/api/",
    "/api/v1/",
    "/api/v2/jobs/",
    "/api/v1/jobs/abc/",
    "/api/v1/jobs/-1/",
    "/api/v1/jobs/1.5/history/",
    "/api/v1/jobs/abc/cancel/",
    "/api/v1/jobs",
    "/api/v1/jobs/1",
    "/api/v1/nope/",
]
# Routes that exist, for a job that does not: GET is a 404.
ABSENT = ["99999999", "99999999999999999999999", "0"]


def assert_json_error(r, status):
    assert r.status_code == status, (r.status_code, r.content[:300])
    assert r["Content-Type"] == "application/json", r["Content-Type"]
    body = r.json()
    assert isinstance(body["detail"], str) and isinstance(body["code"], str)


@pytest.fixture
def api_token(db):
    return authed(new_client("json-errors")[1])


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("path", MISSES)
def test_every_api_miss_is_a_json_404(api_token, settings, path, debug):
    settings.DEBUG = debug
    for method in ("get", "post", "delete"):
        r = getattr(api_token, method)(path)
        assert_json_error(r, 404)


def test_a_post_to_a_miss_is_a_json_404_not_a_csrf_page(db):
    """Found by the schema fuzz: Django's CSRF check answered an HTML 403 first."""
    from django.test import Client as DjangoClient

    _, token = new_client("csrf-miss")
    web = DjangoClient(enforce_csrf_checks=True, HTTP_AUTHORIZATION=f"Token {token}")
    assert_json_error(web.post("/api/v1/jobs/-5.2e-66/cancel/"), 404)
    assert_json_error(web.post("/api/v1/jobs"), 404)


@pytest.mark.parametrize("job_id", ABSENT)
def test_an_absent_job_is_a_json_404(api_token, job_id):
    assert_json_error(api_token.get(f"/api/v1/jobs/{job_id}/"), 404)
    assert_json_error(api_token.get(f"/api/v1/jobs/{job_id}/history/"), 404)
    assert_json_error(api_token.post(f"/api/v1/jobs/{job_id}/cancel/"), 404)


def test_every_method_the_schema_does_not_list_is_a_json_405(api_token, anon):
    schema = yaml.safe_load(anon.get("/api/v1/schema/").content)
    tried = 0
    for path, item in schema["paths"].items():
        concrete = re.sub(r"\{\w+\}", "1", path)
        for method in METHODS:
            if method in item:
                continue
            r = getattr(api_token, method)(concrete)
            assert_json_error(r, 405)
            tried += 1
    for path in ("/api/v1/schema/", "/api/v1/docs/"):
        for method in ("post", "put", "delete"):
            assert_json_error(getattr(anon, method)(path), 405)
            tried += 1
    assert tried >= 20


def test_an_unexpected_error_is_a_json_500(monkeypatch):
    """A bug in a view: the client gets the error shape, not Django's HTML page."""
    from django.test import Client as DjangoClient

    _, token = new_client("json-500")

    def broken(self, request, pk):
        raise RuntimeError("a bug")

    monkeypatch.setattr(JobViewSet, "retrieve", broken)
    web = DjangoClient(raise_request_exception=False, HTTP_AUTHORIZATION=f"Token {token}")
    r = web.get("/api/v1/jobs/1/")
    assert_json_error(r, 500)
    assert r.json() == {"detail": "Internal server error.", "code": "server_error"}
    # Outside /api/ Django's own page is kept.
    assert not web.get("/no-such-page/")["Content-Type"].startswith("application/json")


@pytest.mark.parametrize("value", [":", "abc", "-1", "1.5"])
def test_a_content_length_that_is_not_a_number_is_a_json_400(api_token, value):
    """Found by the schema fuzz: the metrics middleware raised on it (a 500)."""
    body = {"task": "echo", "payload": {}}
    r = api_token.post("/api/v1/jobs/", body, format="json", CONTENT_LENGTH=value)
    assert r.status_code == 400, r.content
    assert r["Content-Type"].startswith("application/json")
    assert r.json()["code"] == "bad_request"


def test_a_header_spelled_content_length_with_an_underscore_is_ignored(api_token):
    """Found by the schema fuzz: `Content_Length: abc` arrives as HTTP_CONTENT_LENGTH, which
    request.headers also names content-length, and the metrics middleware raised on it."""
    r = api_token.get("/api/v1/jobs/", HTTP_CONTENT_LENGTH="abc")
    assert r.status_code == 200, r.content


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/schedules/", {"name": "s", "task": "echo", "interval_seconds": -5}),
        ("/api/v1/workflows/", {"steps": [{"id": "a", "task": "nope", "payload": {}}]}),
        ("/api/v1/jobs/", {"task": "echo", "payload": 1, "colour": "red"}),
    ],
)
def test_detail_carries_the_first_real_message(api, path, body):
    r = api.post(path, body, format="json")
    assert r.status_code == 400, r.content
    data = r.json()
    assert data["detail"] != "Invalid request.", data
    first_field, first = next(iter(data["errors"].items()))
    assert first[0]["message"] in data["detail"], data
