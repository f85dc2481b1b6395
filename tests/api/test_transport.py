"""Truth first, signal after commit (SPEC §1), with real Redis faults: a refused
port, and a private redis-server stopped and started again."""

from __future__ import annotations

import json

import pytest
from django.db import transaction

from jobs import services, submission
from jobs.models import Job, JobEvent
from jobs.transport import get_transport
from tests.api.conftest import authed, new_client

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/api/v1/jobs/"


def submit_echo(api, n=1):
    return api.post(
        URL, data=json.dumps({"task": "echo", "payload": {"n": n}}), content_type="application/json"
    )


def listed(redis_client, queue: str = "default") -> list[int]:
    key = get_transport().key(queue)
    return [int(x) for x in redis_client.lrange(key, 0, -1)]


def shared_redis():
    return get_transport()._client


def test_redis_refusing_connections_parks_the_job_durably(settings, closed_redis_url):
    _, token = new_client()
    settings.REDIS_URL = closed_redis_url
    r = submit_echo(authed(token))
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["status"] == "enqueue_failed"
    job = Job.objects.get(pk=body["id"])  # committed: another connection would see it too
    assert job.status == "enqueue_failed"
    history = list(
        JobEvent.objects.filter(job=job).values_list("from_status", "to_status", "actor")
    )
    assert history == [
        (None, "queued", f"client:{job.client.name}"),
        ("queued", "enqueue_failed", "api"),
    ]


def test_redis_stopped_then_back_loses_nothing(settings, private_redis):
    _, token = new_client()
    api = authed(token)
    settings.REDIS_URL = private_redis.url
    probe = private_redis.client()

    up = submit_echo(api, 1).json()
    assert up["status"] == "queued"
    assert listed(probe) == [up["id"]]

    private_redis.stop()
    down = [submit_echo(api, n).json() for n in (2, 3)]
    assert [d["status"] for d in down] == ["enqueue_failed", "enqueue_failed"]
    assert Job.objects.get(pk=up["id"]).status == "queued"  # its truth did not change

    private_redis.start()  # empty: no persistence, every message is gone
    probe = private_redis.client()
    assert listed(probe) == []
    with transaction.atomic():
        repaired = services.repair_enqueue_failed()
    assert sorted(repaired) == sorted(d["id"] for d in down)
    assert sorted(listed(probe)) == sorted(d["id"] for d in down)
    statuses = dict(Job.objects.values_list("id", "status"))
    assert statuses == {up["id"]: "queued", down[0]["id"]: "queued", down[1]["id"]: "queued"}


def test_push_happens_only_after_the_callers_commit():
    client = shared_redis()
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            job, created = submission.submit("echo", {"x": 1}, queue="txn")
            assert created
            raise RuntimeError("the caller's transaction fails")
    assert not Job.objects.filter(pk=job.pk).exists()
    assert listed(client, "txn") == []

    with transaction.atomic():
        job, _ = submission.submit("echo", {"x": 2}, queue="txn")
        assert listed(client, "txn") == []  # not before the commit
    assert Job.objects.get(pk=job.pk).status == "queued"
    assert listed(client, "txn") == [job.pk]


def test_caller_commit_with_redis_down_parks_the_job(settings, closed_redis_url):
    settings.REDIS_URL = closed_redis_url
    with transaction.atomic():
        job, _ = submission.submit("echo", {}, queue="txn")
    assert Job.objects.get(pk=job.pk).status == "enqueue_failed"


def test_api_submission_is_its_own_durable_transaction():
    """The view refuses to run inside an outer transaction (durable block), so its
    on_commit push can never fire before the real commit."""
    from django.test import RequestFactory
    from rest_framework.test import force_authenticate

    from jobs.api.views import JobViewSet

    client, _ = new_client()
    request = RequestFactory().post(
        URL, data=json.dumps({"task": "echo", "payload": {}}), content_type="application/json"
    )
    force_authenticate(request, user=client)
    view = JobViewSet.as_view({"post": "create"})
    with pytest.raises(RuntimeError, match="durable"):
        with transaction.atomic():
            view(request)
    assert Job.objects.count() == 0
