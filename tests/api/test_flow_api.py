"""Sequences and batches over the API (jobs.api.flow): the fields on a job, the batch and
sequence endpoints, and every refusal a JSON 4xx that writes nothing."""

from __future__ import annotations

import json

import pytest

from jobs import services
from jobs.models import Batch, Job, Sequence

pytestmark = pytest.mark.django_db(transaction=True)


def _post(api, url, body, **headers):
    return api.post(url, data=json.dumps(body), content_type="application/json", **headers)


def _run(job_id: int, *, error: str | None = None) -> None:
    lease = services.claim("w-api", job_id)
    assert lease is not None
    if error is None:
        services.complete([(lease, None)])
    else:
        services.fail([(lease, error, True)])


def test_sequence_key_on_single_and_batch_submissions(api, me):
    r = _post(api, "/api/v1/jobs/", {"task": "echo", "payload": {}, "sequence_key": "acct"})
    assert r.status_code == 201, r.content
    first = r.json()
    assert (first["sequence_key"], first["wait_reason"], first["batch"]) == ("acct", None, None)
    r = _post(api, "/api/v1/jobs/batch/", {"jobs": [
        {"task": "echo", "payload": {}, "sequence_key": "acct"}]})  # fmt: skip
    assert r.status_code == 201, r.content
    second = r.json()["jobs"][0]["id"]
    got = api.get(f"/api/v1/jobs/{second}/").json()
    assert got["wait_reason"] == "sequence"


@pytest.mark.parametrize("bad", ["", "a b", 5, ["x"]])
def test_a_bad_sequence_key_is_a_400_that_writes_nothing(api, me, bad):
    r = _post(api, "/api/v1/jobs/", {"task": "echo", "payload": {}, "sequence_key": bad})
    assert r.status_code == 400, r.content
    assert r.json()["code"] == "invalid_sequence_key"
    assert not Job.objects.exists() and not Sequence.objects.exists()


def test_sequence_page_resume_and_skip(api, me):
    ids = [
        _post(
            api, "/api/v1/jobs/", {"task": "echo", "payload": {"i": i}, "sequence_key": "k/1"}
        ).json()["id"]
        for i in range(3)
    ]
    r = api.get("/api/v1/sequences/", {"key": "k/1"})
    assert r.status_code == 200, r.content
    assert (r.json()["state"], r.json()["active_job"]["id"], r.json()["waiting"]) == (
        "running", ids[0], 2)  # fmt: skip
    r = _post(api, "/api/v1/sequences/resume/", {"key": "k/1"})
    assert (r.status_code, r.json()["code"]) == (409, "sequence_not_halted")
    _run(ids[0], error="boom")
    page = api.get("/api/v1/sequences/", {"key": "k/1"}).json()
    assert (page["state"], page["halted_job"]["id"]) == ("halted", ids[0])
    assert api.get(f"/api/v1/jobs/{ids[1]}/").json()["wait_reason"] == "sequence_halted"
    r = _post(api, "/api/v1/sequences/skip/", {"key": "k/1"})
    assert r.status_code == 200, r.content
    assert r.json()["active_job"]["id"] == ids[1]
    _run(ids[1], error="boom")
    r = _post(api, "/api/v1/sequences/resume/", {"key": "k/1"})
    assert r.status_code == 200, r.content
    assert r.json()["active_job"]["id"] == ids[1]


@pytest.mark.parametrize(
    "method,url,body",
    [
        ("get", "/api/v1/sequences/", {}),
        ("get", "/api/v1/sequences/", {"key": "a b"}),
        ("get", "/api/v1/sequences/", {"key": "a", "other": "1"}),
        ("post", "/api/v1/sequences/resume/", {}),
        ("post", "/api/v1/sequences/skip/", {"key": "a", "x": 1}),
        ("post", "/api/v1/sequences/skip/", [1]),
    ],
)
def test_sequence_refusals_are_json_400(api, me, method, url, body):
    r = api.get(url, body) if method == "get" else _post(api, url, body)
    assert r.status_code == 400, r.content
    assert r.json()["code"]


def test_another_clients_sequence_is_a_404(api, me, other):
    other_api = other[1]
    _post(api, "/api/v1/jobs/", {"task": "echo", "payload": {}, "sequence_key": "mine"})
    assert other_api.get("/api/v1/sequences/", {"key": "mine"}).status_code == 404
    assert _post(other_api, "/api/v1/sequences/skip/", {"key": "mine"}).status_code == 404


def test_batch_create_progress_callback_and_replay(api, me):
    body = {
        "name": "thumbs",
        "jobs": [{"task": "echo", "payload": {"i": i}} for i in range(3)],
        "on_complete": {"task": "echo", "payload": {"to": "ops"}},
        "on_failure": {"task": "echo"},
    }
    r = _post(api, "/api/v1/batches/", body, HTTP_IDEMPOTENCY_KEY="b1")
    assert r.status_code == 201, r.content
    batch = r.json()
    assert (batch["total"], batch["pending"], batch["callbacks"]) == (
        3, 3, {"on_complete": "echo", "on_failure": "echo"})  # fmt: skip
    assert r["Location"].endswith(f"/batches/{batch['id']}/")
    again = _post(api, "/api/v1/batches/", body, HTTP_IDEMPOTENCY_KEY="b1")
    assert (again.status_code, again.json()["id"]) == (200, batch["id"])
    other = _post(api, "/api/v1/batches/", {**body, "name": "x"}, HTTP_IDEMPOTENCY_KEY="b1")
    assert (other.status_code, other.json()["batch_id"]) == (409, batch["id"])

    ids = list(Job.objects.filter(batch_id=batch["id"]).order_by("id").values_list("pk", flat=True))
    assert api.get(f"/api/v1/jobs/{ids[0]}/").json()["batch"] == batch["id"]
    _run(ids[0])
    _run(ids[1], error="boom")
    _run(ids[2])
    done = api.get(f"/api/v1/batches/{batch['id']}/").json()
    assert (done["pending"], done["succeeded"], done["failed"], done["failed_ids"]) == (
        0, 2, 1, [ids[1]])  # fmt: skip
    assert len(done["callback_jobs"]) == 2
    made = Job.objects.get(pk=done["callback_jobs"][0])
    assert made.payload["to"] == "ops" and made.payload["batch"]["failed_ids"] == [ids[1]]
    assert made.client_id == me.pk


@pytest.mark.parametrize(
    "body,where",
    [
        ({"jobs": []}, "jobs"),
        ({"jobs": [{"task": "echo", "payload": {}}], "extra": 1}, "extra"),
        ({"jobs": [{"task": "nope", "payload": {}}]}, "jobs.0.task"),
        ({"jobs": [{"task": "echo", "payload": {}, "idempotency_key": "k"}]},
         "jobs.0.idempotency_key"),
        ({"jobs": [{"task": "echo", "payload": {}}], "on_success": {"task": "nope"}},
         "on_success.task"),
        ({"jobs": [{"task": "echo", "payload": {}}], "on_failure": {"task": "echo", "payload": 3}},
         "on_failure.payload"),
        ({"jobs": [{"task": "echo", "payload": {}}], "name": 7}, "name"),
    ],
)  # fmt: skip
def test_batch_refusals_are_json_400_that_write_nothing(api, me, body, where):
    r = _post(api, "/api/v1/batches/", body)
    assert r.status_code == 400, r.content
    assert where in r.json()["errors"], r.json()
    assert not Job.objects.exists() and not Batch.objects.exists()


def test_batch_odd_bodies_and_another_clients_batch(api, me, other):
    other_api = other[1]
    assert _post(api, "/api/v1/batches/", [1]).status_code == 400
    r = _post(api, "/api/v1/batches/", {"jobs": [{"task": "echo", "payload": {}}]},
              HTTP_IDEMPOTENCY_KEY="no spaces allowed")  # fmt: skip
    assert r.status_code == 400
    made = _post(api, "/api/v1/batches/", {"jobs": [{"task": "echo", "payload": {}}]}).json()
    assert other_api.get(f"/api/v1/batches/{made['id']}/").status_code == 404
    assert api.get("/api/v1/batches/999999/").status_code == 404
