"""A job's own attempt timeout (issue 27): accepted by both endpoints and submit(),
stored on the row, returned by the API, part of an idempotent request; bad values are
a JSON 400 that writes nothing. The worker's use of it is in test_containment_e2e.py."""

from __future__ import annotations

import json

import pytest

from jobs.models import Job
from jobs.submission import submit
from tests.api.conftest import counts

pytestmark = pytest.mark.django_db(transaction=True)


def post(api, url, body, **extra):
    return api.post(url, data=json.dumps(body), content_type="application/json", **extra)


def test_single_and_batch_store_the_timeout_and_show_it(api):
    r = post(api, "/api/v1/jobs/", {"task": "echo", "payload": {}, "timeout": 2.5})
    assert r.status_code == 201, r.content
    assert r.json()["timeout"] == 2.5
    assert Job.objects.get(pk=r.json()["id"]).timeout == 2.5
    assert api.get(f"/api/v1/jobs/{r.json()['id']}/").json()["timeout"] == 2.5

    r = post(
        api,
        "/api/v1/jobs/batch/",
        {"jobs": [{"task": "echo", "payload": {}, "timeout": 30}, {"task": "echo", "payload": 1}]},
    )
    assert r.status_code == 201, r.content
    ids = [j["id"] for j in r.json()["jobs"]]
    assert [Job.objects.get(pk=i).timeout for i in ids] == [30.0, None]


def test_submit_takes_a_timeout():
    job, created = submit("echo", {}, timeout=7)
    assert created and Job.objects.get(pk=job.pk).timeout == 7.0


@pytest.mark.parametrize("bad", [0, -3, "10", True, 86401, [5]])
def test_bad_timeouts_are_a_json_400_that_writes_nothing(api, bad):
    before = counts()
    r = post(api, "/api/v1/jobs/", {"task": "echo", "payload": {}, "timeout": bad})
    assert r.status_code == 400, r.content
    assert r.json()["code"] == "invalid_timeout" and "timeout" in r.json()["detail"]
    r = post(
        api, "/api/v1/jobs/batch/", {"jobs": [{"task": "echo", "payload": {}, "timeout": bad}]}
    )
    assert r.status_code == 400, r.content
    assert "jobs.0.timeout" in json.dumps(r.json())
    assert counts() == before


def test_the_timeout_is_part_of_an_idempotent_request(api):
    body = {"task": "echo", "payload": {}, "timeout": 5}
    first = post(api, "/api/v1/jobs/", body, HTTP_IDEMPOTENCY_KEY="k-timeout")
    again = post(api, "/api/v1/jobs/", body, HTTP_IDEMPOTENCY_KEY="k-timeout")
    assert (first.status_code, again.status_code) == (201, 200)
    other = post(api, "/api/v1/jobs/", {**body, "timeout": 6}, HTTP_IDEMPOTENCY_KEY="k-timeout")
    assert other.status_code == 409, other.content


def test_a_schedules_timeout_goes_to_the_jobs_it_makes(api):
    from django.db import transaction

    from jobs.schedules import firing

    body = {"name": "t", "interval_seconds": 60, "task": "echo", "payload": {}, "timeout": 9}
    r = api.post("/api/v1/schedules/", body, format="json")
    assert r.status_code == 201, r.content
    assert r.json()["timeout"] == 9.0
    with transaction.atomic():
        fired = firing.run_now(r.json()["id"], "staff:ann")
    assert Job.objects.get(pk=fired.job_id).timeout == 9.0
    bad = api.post("/api/v1/schedules/", {**body, "name": "u", "timeout": 0}, format="json")
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_timeout"


def test_a_workflow_steps_timeout_goes_to_its_job(api):
    steps = [
        {"id": "a", "task": "echo", "payload": {}, "timeout": 4},
        {"id": "b", "task": "echo", "payload": {}, "after": ["a"]},
    ]
    r = api.post("/api/v1/workflows/", {"name": "w", "steps": steps}, format="json")
    assert r.status_code == 201, r.content
    jobs = Job.objects.filter(workflow_node__workflow_id=r.json()["id"]).order_by("id")
    assert [j.timeout for j in jobs] == [4.0, None]
    before = counts()
    bad = [{"id": "a", "task": "echo", "payload": {}, "timeout": -1}]
    r = api.post("/api/v1/workflows/", {"name": "x", "steps": bad}, format="json")
    assert r.status_code == 400 and "invalid_timeout" in r.content.decode()
    assert counts() == before
