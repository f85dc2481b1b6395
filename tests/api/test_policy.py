"""The API keeps its own authentication, permission, throttle and error shape in a host
project whose REST_FRAMEWORK says nothing (DRF's defaults: AllowAny, no throttle), and
names the scheme it expects when a client sends another one."""

from __future__ import annotations

import pytest
from django.test import override_settings
from django.urls import URLPattern, get_resolver

from jobs.api.auth import ClientTokenAuthentication, IsClient
from jobs.api.errors import api_not_found
from jobs.api.policy import APIPolicy
from tests.api.conftest import RecordingAPIClient, new_client

PUBLIC = {"api-schema", "api-docs"}


def api_views() -> dict[str, type]:
    """Every DRF view of jobs.api.urls; the last route, the JSON 404 of a miss, serves
    nothing and needs no policy."""
    patterns = get_resolver("jobs.api.urls").url_patterns
    assert patterns[-1].callback is api_not_found
    return {p.name: p.callback.cls for p in patterns[:-1] if isinstance(p, URLPattern)}


def test_every_api_view_but_the_schema_and_docs_carries_the_policy():
    views = api_views()
    assert len(views) > 10
    missing = sorted(
        name for name, cls in views.items() if name not in PUBLIC and not issubclass(cls, APIPolicy)
    )
    assert not missing, f"inherit jobs.api.policy.APIPolicy: {missing}"


@pytest.mark.django_db
@override_settings(REST_FRAMEWORK={})
def test_with_drfs_defaults_the_api_still_needs_a_client_token():
    anon = RecordingAPIClient()
    view = api_views()["job-list"]
    assert view.authentication_classes == [ClientTokenAuthentication]
    assert view.permission_classes == [IsClient]
    r = anon.get("/api/v1/jobs/")
    assert r.status_code == 401 and r.json()["code"] == "not_authenticated", r.content
    r = anon.post("/api/v1/jobs/", {"task": "echo", "payload": 1}, format="json")
    assert r.status_code == 401


@pytest.mark.django_db
def test_bearer_is_accepted_like_token():
    anon = RecordingAPIClient()
    _, token = new_client()
    anon.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    r = anon.get("/api/v1/jobs/")
    assert r.status_code == 200, r.content


@pytest.mark.django_db
def test_another_scheme_is_answered_with_the_expected_one():
    anon = RecordingAPIClient()
    _, token = new_client()
    anon.credentials(HTTP_AUTHORIZATION=f"Basic {token}")
    r = anon.get("/api/v1/jobs/")
    assert r.status_code == 401
    assert "Authorization: Token <token>" in r.json()["detail"], r.json()
    assert "Basic" in r.json()["detail"]


@pytest.mark.django_db
@override_settings(REST_FRAMEWORK={}, ROOT_URLCONF="tests.api.host_urls")
def test_with_drfs_defaults_the_schema_and_docs_pages_load_in_a_host_project():
    """No DEFAULT_SCHEMA_CLASS (startproject's REST_FRAMEWORK): the generator walks the
    schema and docs views too, which must carry drf-spectacular's schema class."""
    anon = RecordingAPIClient()
    r = anon.get("/jobs/api/schema/?format=json")
    assert r.status_code == 200, r.content[:2000]
    assert "/jobs/api/jobs/" in r.json()["paths"]
    r = anon.get("/jobs/api/docs/")
    assert r.status_code == 200 and b"swagger" in r.content.lower()
