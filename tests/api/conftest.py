"""API test fixtures: authenticated clients that record which routes they hit, and a
closed Redis port. A private redis-server comes from the root conftest (`private_redis`)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from django.core.cache import cache
from rest_framework.test import APIClient

from jobs import admission
from jobs.api.auth import ClientRateThrottle
from jobs.models import Client, Job, JobEvent
from tests.harness import free_port

API_DIR = Path(__file__).parent
COVERAGE_TEST = "test_every_schema_operation_is_exercised"

# (METHOD, "/api/v1/jobs/{id}/") for every request a RecordingAPIClient made in this run.
EXERCISED: set[tuple[str, str]] = set()
DESELECTED_API_TESTS: list[str] = []


def route_template(route: str) -> str:
    """Django route → OpenAPI path: "api/v1/jobs/<int:pk>/" → "/api/v1/jobs/{id}/"."""
    path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)
    return "/" + path.replace("{pk}", "{id}")


class RecordingAPIClient(APIClient):
    def request(self, **kwargs):
        response = super().request(**kwargs)
        match = getattr(response, "resolver_match", None)
        if match is not None and match.route and response.status_code != 405:
            EXERCISED.add((kwargs["REQUEST_METHOD"].upper(), route_template(match.route)))
        return response


def pytest_collection_modifyitems(config, items):
    """The schema-coverage test needs every other API test to have run first."""
    last = [i for i in items if i.name == COVERAGE_TEST]
    items[:] = [i for i in items if i.name != COVERAGE_TEST] + last


def pytest_deselected(items):
    DESELECTED_API_TESTS.extend(i.nodeid for i in items if Path(i.path).parent == API_DIR)


@pytest.fixture(autouse=True)
def _fresh_caches():
    """Backpressure readings and throttle counters are per process: reset per test."""
    admission.clear_depth_cache()
    cache.clear()
    ClientRateThrottle.reset()
    yield
    admission.clear_depth_cache()
    cache.clear()
    ClientRateThrottle.reset()


def new_client(name: str | None = None) -> tuple[Client, str]:
    name = name or f"client-{time.monotonic_ns()}"
    return Client.create_with_token(name)


def authed(token: str) -> RecordingAPIClient:
    api = RecordingAPIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return api


@pytest.fixture
def client_and_token(db) -> tuple[Client, str]:
    return new_client("alice")


@pytest.fixture
def api(client_and_token) -> RecordingAPIClient:
    return authed(client_and_token[1])


@pytest.fixture
def me(client_and_token) -> Client:
    return client_and_token[0]


@pytest.fixture
def other(db) -> tuple[Client, RecordingAPIClient]:
    c, token = new_client("bob")
    return c, authed(token)


@pytest.fixture
def anon() -> RecordingAPIClient:
    return RecordingAPIClient()


def counts() -> tuple[int, int]:
    """(jobs, history rows): what "nothing was written" is checked against."""
    return Job.objects.count(), JobEvent.objects.count()


@pytest.fixture
def closed_redis_url() -> str:
    """A Redis URL on a port nobody listens on: connections are refused at once."""
    return f"redis://127.0.0.1:{free_port()}/0"
