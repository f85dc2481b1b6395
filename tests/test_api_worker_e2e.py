"""Every built-in task through the REST API and a real runworker process."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from jobs.models import Client
from tests.harness import wait_until

pytestmark = pytest.mark.slow


def test_builtin_tasks_through_the_api_and_a_worker(stack):
    _, token = Client.create_with_token("e2e")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    submitted = {
        "echo": api.post(
            "/api/v1/jobs/", {"task": "echo", "payload": {"x": [1, 2]}}, format="json"
        ),
        "sleep": api.post(
            "/api/v1/jobs/", {"task": "sleep", "payload": {"seconds": 0.3}}, format="json"
        ),
        "fail": api.post(
            "/api/v1/jobs/", {"task": "fail", "payload": {}, "max_retries": 1}, format="json"
        ),
    }
    assert {name: r.status_code for name, r in submitted.items()} == dict.fromkeys(submitted, 201)
    stack.worker("--concurrency", "3", JOBS_RETRY_BACKOFF_BASE="0.1")

    def fetch(name):
        return api.get(f"/api/v1/jobs/{submitted[name].json()['id']}/").json()

    wait_until(
        lambda: all(fetch(n)["status"] in ("done", "failed") for n in submitted),
        30,
        message="all terminal",
    )
    echo, nap, bad = fetch("echo"), fetch("sleep"), fetch("fail")
    assert (echo["status"], echo["result"]) == ("done", {"x": [1, 2]})
    assert nap["status"] == "done" and nap["result"]["slept"] >= 0.3
    assert (bad["status"], bad["retry_count"], bad["error"]) == (
        "failed",
        2,
        "RetryableError: fail task always fails",
    )
    history = api.get(f"/api/v1/jobs/{bad['id']}/history/").json()
    events = history["results"] if isinstance(history, dict) else history
    assert [e["to_status"] for e in events] == [
        "queued",
        "processing",
        "queued",
        "processing",
        "failed",
    ]
