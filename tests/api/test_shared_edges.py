"""What clients share is not theirs to take (SPEC §12): the service's own queues take no
client jobs on any path (D197), and one client's backlog or parked jobs answer 429 to
that client only (D198). Requests go through the deployment's WSGI application, the
single submission's lane in front of Django."""

from __future__ import annotations

import json

import pytest
from django.core.handlers.wsgi import WSGIHandler

from jobs import admission, submission
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
        "workflow": ("/api/v1/workflows/", {"name": "w", "steps": [
            {"id": "a", "task": "echo", "payload": {}, "queue": queue}]}),
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


# --- the depth: due work shared, each client's backlog its own (D198) ---------------------

FAR = "9999-01-01T00:00:00Z"


def test_parked_jobs_of_one_client_refuse_nobody_else(app, settings):
    """The issue's case: one client's backlog and its far-future jobs took the queue past
    JOBS_MAX_QUEUE_DEPTH, and every other client got 429 until they were cancelled."""
    settings.JOBS_MAX_QUEUE_DEPTH = 20
    _, noisy = new_client()
    due = [{"task": "echo", "payload": {"n": n}} for n in range(15)]
    assert post(app, noisy, f"{JOBS}batch/", {"jobs": due})[0] == 201
    for n in range(6):  # one at a time: each fits below the limit, the last goes past it
        later = {"task": "echo", "payload": {"n": n}, "run_at": FAR}
        assert post(app, noisy, JOBS, later)[0] == 201
    admission.clear_depth_cache()  # another process, or a second later

    other, token = new_client()
    single = post(app, token, JOBS, {"task": "echo", "payload": {}})
    batch = post(app, token, f"{JOBS}batch/", {"jobs": [{"task": "echo", "payload": {}}] * 2})
    flow = post(app, token, "/api/v1/workflows/",
                {"name": "w", "steps": [{"id": "a", "task": "echo", "payload": {}}]})  # fmt: skip
    assert [single[0], batch[0], flow[0]] == [201, 201, 201], (single, batch, flow)
    assert Job.objects.filter(client=other).count() == 4
    # Due work still protects the workers: past the limit of due jobs, 429 for everyone.
    more = [{"task": "echo", "payload": {}}] * 2
    status, headers, answer = post(app, token, f"{JOBS}batch/", {"jobs": more})
    assert (status, answer["code"], headers["Retry-After"]) == (429, "queue_full", "5"), answer


def test_a_clients_own_backlog_answers_429_to_that_client_only(app, settings):
    """A client's share (its limit in the admin, else JOBS_MAX_CLIENT_QUEUE_DEPTH) counts
    every queued job it holds in the queue, parked ones included; the shared depth is far."""
    settings.JOBS_MAX_QUEUE_DEPTH = 1000
    settings.JOBS_MAX_CLIENT_QUEUE_DEPTH = 6
    noisy, token = new_client()
    noisy.max_queue_depth = 4  # staff set it on the client's admin page
    noisy.save()
    for n in range(3):
        assert (
            post(app, token, JOBS, {"task": "echo", "payload": {"n": n}, "run_at": FAR})[0] == 201
        )
    status, _, keyed = post(app, token, JOBS, {"task": "echo", "payload": {}, "unique_key": "k"})
    assert status == 201
    refused = {
        "single": post(app, token, JOBS, {"task": "echo", "payload": {"n": 9}}),
        "batch": post(app, token, f"{JOBS}batch/", {"jobs": [{"task": "echo", "payload": {}}]}),
        "workflow": post(app, token, "/api/v1/workflows/", {"name": "w", "steps": [
            {"id": "a", "task": "echo", "payload": {}}]}),
    }  # fmt: skip
    for what, (status, headers, answer) in refused.items():
        assert (status, answer["code"]) == (429, "client_queue_full"), (what, answer)
        assert headers["Retry-After"] == "5", what
    assert Job.objects.filter(client=noisy).count() == 4
    # A replay of what was accepted is still answered.
    replay = post(app, token, JOBS, {"task": "echo", "payload": {}, "unique_key": "k"})
    assert (replay[0], replay[2]["id"]) == (200, keyed["id"]), replay
    # Everyone else submits, up to their own share (the setting's).
    other, other_token = new_client()
    batch = [{"task": "echo", "payload": {}}] * 6
    assert post(app, other_token, f"{JOBS}batch/", {"jobs": batch})[0] == 201
    status, _, answer = post(app, other_token, JOBS, {"task": "echo", "payload": {}})
    assert (status, answer["code"]) == (429, "client_queue_full"), answer
    # Code without a client has no share.
    assert submission.submit("echo", {})[1]
