"""What clients share is not theirs to take (SPEC §12): the service's own queues take no
client jobs on any path (D197), and one client's backlog or parked jobs answer 429 to
that client only (D198). Requests go through the deployment's WSGI application, the
single submission's lane in front of Django."""

from __future__ import annotations

import json

import pytest
from django.core.handlers.wsgi import WSGIHandler

from jobs import submission
from jobs.api.fastlane import FastLane
from jobs.models import Job, Schedule
from tests.api.conftest import new_client
from tests.api.test_fastlane import call

pytestmark = pytest.mark.django_db(transaction=True)

JOBS = "/api/v1/jobs/"


@pytest.fixture
def app():
    return FastLane(WSGIHandler())


def post(app, token, path, body, method="POST"):
    status, headers, content = call(
        app, body=json.dumps(body).encode(), method=method, path=path,
        HTTP_AUTHORIZATION=f"Token {token}",
    )  # fmt: skip
    return int(status.split()[0]), dict(headers), json.loads(content)


def codes(answer: dict) -> set[str]:
    return {answer["code"]} | {e["code"] for es in answer.get("errors", {}).values() for e in es}


# --- internal queues (D197) -------------------------------------------------------------


def paths(queue: str) -> dict[str, tuple[str, dict]]:
    return {
        "single": (JOBS, {"task": "echo", "payload": {}, "queue": queue}),
        "batch": (f"{JOBS}batch/", {"jobs": [{"task": "echo", "payload": {}, "queue": queue}]}),
        "workflow": ("/api/v1/workflows/",
                     {"steps": [{"id": "a", "task": "echo", "payload": {}, "queue": queue}]}),
        "schedule": ("/api/v1/schedules/", {"name": "s", "interval_seconds": 60, "task": "echo",
                                            "payload": {}, "queue": queue}),
    }  # fmt: skip


@pytest.mark.parametrize("queue", ["webhooks", "ops"])
def test_no_client_submits_into_an_internal_queue_on_any_path(app, settings, queue):
    """The built-in `webhooks` queue and one an operator marked internal: a client's job
    there would hold up the service's own deliveries (four sleeps delayed one by 41 s)."""
    settings.JOBS_QUEUES = {"default": {}, "ops": {"internal": True}}
    me, token = new_client()
    for what, (path, body) in paths(queue).items():
        status, _, answer = post(app, token, path, body)
        assert status == 400, (what, status, answer)
        assert "unknown_queue" in codes(answer), (what, answer)
        assert "webhooks" not in json.dumps(answer).split("JOBS_QUEUES")[-1], answer  # unlisted
        assert "ops" not in json.dumps(answer).split("JOBS_QUEUES")[-1], answer
    status, _, schedule = post(app, token, "/api/v1/schedules/", paths("default")["schedule"][1])
    assert status == 201, schedule
    status, _, answer = post(app, token, f"/api/v1/schedules/{schedule['id']}/",
                             {"queue": queue}, method="PATCH")  # fmt: skip
    assert (status, answer["code"]) == (400, "unknown_queue"), answer
    assert Schedule.objects.get(pk=schedule["id"]).queue == "default"
    assert not Job.objects.filter(client=me).exists()
    # The service's own code still submits there.
    job, created = submission.submit("echo", {}, queue=queue)
    assert created and job.queue == queue
