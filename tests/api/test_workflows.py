"""The API of signals and workflows: owner only (404 for others), 409 rules, all or
nothing creation, and the schema that describes them."""

from __future__ import annotations

import pytest

from jobs import services
from jobs.models import Job, JobSignal, Workflow, WorkflowNode
from tests.api.test_schema import fetch_schema

pytestmark = pytest.mark.django_db


def _job(client) -> Job:
    return services.submit("echo", {}, client_id=client.pk)[0]


def test_signal_to_a_job_not_yet_waiting_is_kept(api, me):
    job = _job(me)
    r = api.post(f"/api/v1/jobs/{job.pk}/signal/", {"key": "approval", "payload": {"ok": 1}},
                 format="json")  # fmt: skip
    assert r.status_code == 202, r.content
    assert r.json() == {"job_id": job.pk, "key": "approval", "woke": False}
    signal = JobSignal.objects.get(job_id=job.pk)
    assert (signal.key, signal.payload, signal.sent_by) == (
        "approval",
        {"ok": 1},
        "client:" + me.name,
    )


def test_signal_wakes_a_job_parked_for_that_key(api, me):
    job = _job(me)
    lease = services.claim("w-api", job.pk)
    from jobs.lifecycle import BLOCKED_RUN_AT, WaitReason

    services.suspend(lease, reason=WaitReason.SIGNAL, key="go", until=BLOCKED_RUN_AT)
    assert services.claim("w-api", job.pk) is None  # parked
    other_key = api.post(f"/api/v1/jobs/{job.pk}/signal/", {"key": "stop"}, format="json")
    assert other_key.status_code == 409 and other_key.json()["code"] == "not_waiting_for_key"
    assert not JobSignal.objects.filter(job_id=job.pk, key="stop").exists()
    r = api.post(f"/api/v1/jobs/{job.pk}/signal/", {"key": "go"}, format="json")
    assert r.status_code == 202 and r.json()["woke"] is True
    job.refresh_from_db()
    assert job.wait_reason is None and job.status == "queued"
    assert services.claim("w-api", job.pk) is not None  # due now


def test_signal_refusals(api, me, other):
    job = _job(me)
    url = f"/api/v1/jobs/{job.pk}/signal/"
    assert api.post(url, {"key": "k"}, format="json").status_code == 202
    dup = api.post(url, {"key": "k"}, format="json")
    assert dup.status_code == 409 and dup.json()["code"] == "duplicate_signal"
    assert other[1].post(url, {"key": "x"}, format="json").status_code == 404
    assert (
        api.post("/api/v1/jobs/999999999/signal/", {"key": "x"}, format="json").status_code == 404
    )
    bad = api.post(url, {"payload": 1}, format="json")
    assert bad.status_code == 400 and "key" in bad.json()["errors"]
    extra = api.post(url, {"key": "y", "nope": 1}, format="json")
    assert extra.status_code == 400
    services.cancel([job.pk], actor="staff:t")
    done = api.post(url, {"key": "z"}, format="json")
    assert done.status_code == 409 and done.json()["code"] == "job_finished"
    assert list(JobSignal.objects.filter(job_id=job.pk).values_list("key", flat=True)) == ["k"]


def test_create_read_and_cancel_a_workflow(api, me, other):
    body = {
        "name": "etl",
        "steps": [
            {"id": "a", "task": "echo", "payload": {"n": 1}},
            {"id": "b", "task": "echo", "payload": {}, "after": ["a"], "priority": 5},
        ],
    }
    r = api.post("/api/v1/workflows/", body, format="json")
    assert r.status_code == 201, r.content
    wf = r.json()
    assert r["Location"].endswith(f"/api/v1/workflows/{wf['id']}/")
    assert wf["status"] == "running" and wf["on_failure"] == "fail_dependents"
    steps = {s["id"]: s for s in wf["steps"]}
    assert steps["b"]["after"] == ["a"] and steps["b"]["wait_reason"] == "parents"
    assert Job.objects.get(pk=steps["b"]["job_id"]).client_id == me.pk
    got = api.get(f"/api/v1/workflows/{wf['id']}/")
    assert got.status_code == 200 and got.json()["steps"] == wf["steps"]
    assert other[1].get(f"/api/v1/workflows/{wf['id']}/").status_code == 404
    assert other[1].post(f"/api/v1/workflows/{wf['id']}/cancel/").status_code == 404
    assert api.get("/api/v1/workflows/999999999/").status_code == 404
    c = api.post(f"/api/v1/workflows/{wf['id']}/cancel/")
    assert c.status_code == 200
    assert [s["status"] for s in c.json()["steps"]] == ["failed", "failed"]
    assert c.json()["status"] == "failed"


@pytest.mark.parametrize(
    "steps,code",
    [
        ([{"id": "a", "task": "echo", "payload": {}, "after": ["a"]}], "cycle"),
        ([{"id": "a", "task": "echo", "payload": {}, "after": ["b"]}], "unknown_step"),
        ([{"id": "a", "task": "nope", "payload": {}}], "unknown_task"),
        ([{"id": str(i), "task": "echo", "payload": {}} for i in range(1001)], "too_many_steps"),
    ],
    ids=["cycle", "unknown-id", "unknown-task", "oversized"],
)
def test_a_refused_workflow_is_400_and_writes_nothing(api, steps, code):
    before = (Job.objects.count(), Workflow.objects.count(), WorkflowNode.objects.count())
    r = api.post("/api/v1/workflows/", {"name": "bad", "steps": steps}, format="json")
    assert r.status_code == 400, r.content
    assert code in [e["code"] for errs in r.json()["errors"].values() for e in errs]
    assert (Job.objects.count(), Workflow.objects.count(), WorkflowNode.objects.count()) == before


def test_schema_describes_signals_and_workflows(anon):
    paths = fetch_schema(anon)["paths"]
    assert {"202", "404", "409"} <= set(paths["/api/v1/jobs/{id}/signal/"]["post"]["responses"])
    assert {"201", "400"} <= set(paths["/api/v1/workflows/"]["post"]["responses"])


def test_an_idempotency_key_replays_the_workflow_or_conflicts(api, me, other):
    body = {"name": "once", "steps": [{"id": "a", "task": "echo", "payload": {"n": 1}}]}
    headers = {"HTTP_IDEMPOTENCY_KEY": "wf-key-1"}
    first = api.post("/api/v1/workflows/", body, format="json", **headers)
    assert first.status_code == 201, first.content
    counts = (Job.objects.count(), Workflow.objects.count())
    again = api.post("/api/v1/workflows/", body, format="json", **headers)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    assert (Job.objects.count(), Workflow.objects.count()) == counts  # nothing new
    changed = {**body, "name": "twice"}
    conflict = api.post("/api/v1/workflows/", changed, format="json", **headers)
    assert conflict.status_code == 409
    assert conflict.json()["code"] == "idempotency_conflict"
    assert conflict.json()["workflow_id"] == first.json()["id"]
    # Keys are per client: another client's same key is its own workflow.
    theirs = other[1].post("/api/v1/workflows/", body, format="json", **headers)
    assert theirs.status_code == 201 and theirs.json()["id"] != first.json()["id"]
    bad = api.post("/api/v1/workflows/", body, format="json", HTTP_IDEMPOTENCY_KEY="has space")
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_idempotency_key"
    assert (Job.objects.count(), Workflow.objects.count()) == (counts[0] + 1, counts[1] + 1)
