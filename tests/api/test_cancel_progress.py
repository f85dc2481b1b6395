"""The API's side of issue 22: cancel a running job (202), the progress field, and the
schema that describes both."""

from __future__ import annotations

import pytest

from jobs import services
from jobs.models import Job, JobEvent
from tests.api.test_schema import fetch_schema
from tests.factories import JobFactory, raw

pytestmark = pytest.mark.django_db


def make(client, status="queued", **kw) -> Job:
    return JobFactory.create(status=status, client_id=client.pk, **kw)


def lease_of(job: Job) -> services.Lease:
    return services.Lease(job.pk, job.lease_version, job.owned_by, job.task, {}, job.queue,
                          job.retry_count, job.max_retries, job.created_at)  # fmt: skip


def test_cancel_a_processing_job_is_202_and_records_the_request(api, me):
    job = make(me, "processing", worker="w-1")
    r = api.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert r.status_code == 202, r.content
    body = r.json()
    assert body["status"] == "processing" and body["error"] is None
    assert body["cancel_requested_at"] is not None and body["cancel_too_late"] is False
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.lease_version, row.owned_by) == ("processing", 1, "w-1")
    event = JobEvent.objects.filter(job_id=job.pk).order_by("-id").first()
    assert (event.kind, event.actor) == ("cancel_requested", "client:alice")
    history = api.get(f"/api/v1/jobs/{job.pk}/history/").json()
    assert history["results"][-1]["kind"] == "cancel_requested"
    assert history["results"][-1]["role"] == "client"
    # Asking twice is still 202 and keeps the first request.
    again = api.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert again.status_code == 202
    assert again.json()["cancel_requested_at"] == body["cancel_requested_at"]


def test_a_handler_that_finished_anyway_shows_the_cancel_came_too_late(api, me):
    job = make(me, "processing", worker="w-1")
    assert api.post(f"/api/v1/jobs/{job.pk}/cancel/").status_code == 202
    services.complete([(lease_of(job), {"ok": True})])
    body = api.get(f"/api/v1/jobs/{job.pk}/").json()
    assert (body["status"], body["result"], body["cancel_too_late"]) == ("done", {"ok": True}, True)
    r = api.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert r.status_code == 409 and r.json()["status"] == "done"


def test_cancel_of_an_unknown_or_anothers_running_job_is_404(api, me, other):
    bob, _ = other
    theirs = make(bob, "processing")
    assert api.post("/api/v1/jobs/999999999/cancel/").status_code == 404
    r = api.post(f"/api/v1/jobs/{theirs.pk}/cancel/")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    assert Job.objects.get(pk=theirs.pk).cancel_requested_at is None


def test_progress_is_null_until_reported_then_has_a_fraction(api, me):
    job = make(me, "processing", worker="w-1")
    assert api.get(f"/api/v1/jobs/{job.pk}/").json()["progress"] is None
    services.heartbeat([lease_of(job)], [{"done": 3, "total": 4, "message": "three"}])
    p = api.get(f"/api/v1/jobs/{job.pk}/").json()["progress"]
    assert (p["done"], p["total"], p["fraction"], p["message"]) == (3, 4, 0.75, "three")
    assert p["updated_at"]
    raw("""UPDATE jobs_job SET progress = '{"done": 7, "total": null, "message": ""}'
           WHERE id = %s""", [job.pk])  # fmt: skip
    listed = api.get("/api/v1/jobs/").json()["results"]
    p = next(j for j in listed if j["id"] == job.pk)["progress"]
    assert (p["done"], p["total"], p["fraction"]) == (7, None, None)


def test_schema_describes_202_and_the_progress_field(anon):
    schema = fetch_schema(anon)
    cancel = schema["paths"]["/api/v1/jobs/{id}/cancel/"]["post"]
    assert {"200", "202", "401", "404", "409"} <= set(cancel["responses"])
    job = schema["components"]["schemas"]["Job"]["properties"]
    assert {"progress", "cancel_requested_at", "cancel_too_late"} <= set(job)
    assert job["progress"]["allOf"] == [{"$ref": "#/components/schemas/Progress"}]
    progress = schema["components"]["schemas"]["Progress"]
    assert set(progress["properties"]) == {"done", "total", "fraction", "message", "updated_at"}
    assert job["progress"].get("nullable") is True
