"""The job field `concurrency_key` wherever a job is described: single and batch
submissions, `submit()`, schedules (the jobs they fire) and workflow steps; a bad key
is a 400 `invalid_concurrency_key` that writes nothing. What the key does to claims is
in tests/test_fair_keys.py."""

from __future__ import annotations

import json

import pytest
from django.db import transaction

from jobs.models import Job, Schedule
from jobs.schedules import firing
from jobs.submission import InvalidSubmission, submit
from tests.api.conftest import counts


def _post(api, url, body):
    return api.post(url, data=json.dumps(body), content_type="application/json")


@pytest.mark.django_db
def test_single_and_batch_submissions_store_the_key(api, me):
    r = _post(api, "/api/v1/jobs/", {"task": "echo", "payload": {}, "concurrency_key": "acct-7"})
    assert r.status_code == 201, r.content
    assert r.json()["concurrency_key"] == "acct-7"
    assert Job.objects.get(pk=r.json()["id"]).concurrency_key == "acct-7"
    r = _post(
        api,
        "/api/v1/jobs/batch/",
        {"jobs": [{"task": "echo", "payload": {}, "concurrency_key": "a"},
                  {"task": "echo", "payload": {}}]},
    )  # fmt: skip
    assert r.status_code == 201, r.content
    ids = [j["id"] for j in r.json()["jobs"]]
    assert [Job.objects.get(pk=i).concurrency_key for i in ids] == ["a", None]
    assert all(Job.objects.get(pk=i).client_id == me.pk for i in ids)


@pytest.mark.django_db
@pytest.mark.parametrize("key", ["", "has space", "x" * 201, 7, "caf\u00e9", "nul\u0000"])
def test_a_bad_key_is_a_clear_400_and_writes_nothing(api, key):
    before = counts()
    r = _post(api, "/api/v1/jobs/", {"task": "echo", "payload": {}, "concurrency_key": key})
    assert r.status_code == 400, r.content
    assert r.json()["code"] == "invalid_concurrency_key"
    r = _post(
        api,
        "/api/v1/jobs/batch/",
        {"jobs": [{"task": "echo", "payload": {}, "concurrency_key": key}]},
    )
    assert r.status_code == 400, r.content
    assert "jobs.0.concurrency_key" in r.json()["errors"]
    assert counts() == before


@pytest.mark.django_db
def test_submit_from_code_takes_the_key():
    with transaction.atomic():
        job, _ = submit("echo", {}, concurrency_key="tenant:9")
    assert Job.objects.get(pk=job.pk).concurrency_key == "tenant:9"
    with pytest.raises(InvalidSubmission, match="concurrency_key must be"):
        submit("echo", {}, concurrency_key="two words")


@pytest.mark.django_db
def test_a_schedule_keeps_the_key_and_its_jobs_carry_it(api):
    body = {"name": "nightly", "cron": "0 3 * * *", "task": "echo", "concurrency_key": "n"}
    r = _post(api, "/api/v1/schedules/", body)
    assert r.status_code == 201, r.content
    assert r.json()["concurrency_key"] == "n"
    schedule = Schedule.objects.get(pk=r.json()["id"])
    with transaction.atomic():
        fired = firing.run_now(schedule.pk, "staff:test")
    assert Job.objects.get(pk=fired.job_id).concurrency_key == "n"
    r = _post(api, "/api/v1/schedules/", {**body, "name": "bad", "concurrency_key": "a b"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_concurrency_key"
    assert not Schedule.objects.filter(name="bad").exists()


@pytest.mark.django_db
def test_workflow_steps_carry_the_key(api):
    body = {
        "name": "etl",
        "steps": [
            {"id": "fetch", "task": "echo", "payload": {}, "concurrency_key": "src-1"},
            {"id": "load", "task": "echo", "payload": {}, "after": ["fetch"]},
        ],
    }
    r = api.post("/api/v1/workflows/", body, format="json")
    assert r.status_code == 201, r.content
    steps = {s["id"]: s["job_id"] for s in r.json()["steps"]}
    assert Job.objects.get(pk=steps["fetch"]).concurrency_key == "src-1"
    assert Job.objects.get(pk=steps["load"]).concurrency_key is None
    before = counts()
    body["steps"][1]["concurrency_key"] = "bad key"
    r = api.post("/api/v1/workflows/", body, format="json")
    assert r.status_code == 400, r.content
    assert "steps[1].concurrency_key" in r.json()["errors"]
    assert counts() == before
