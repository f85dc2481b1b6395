"""Unique jobs (seed 002 `unique_key`): while a job with a key is live, submitting the
key again returns it; once it is terminal the key is free. Enforced by the partial
unique index job_unique_key_live, raced here with real connections."""

from __future__ import annotations

import json

import pytest
from django.db import transaction

from jobs import services
from jobs.models import Job
from jobs.submission import InvalidSubmission, submit
from tests.api.conftest import authed, counts, new_client
from tests.factories import raw
from tests.race import race

URL = "/api/v1/jobs/"
BODY = {"task": "echo", "payload": {"n": 1}, "unique_key": "nightly-report"}


def post(api, body):
    return api.post(URL, data=json.dumps(body), content_type="application/json")


def finish(job_id: int, status: str = "done") -> None:
    """Take a job to a terminal state the way a worker does (claim, then final write)."""
    lease = services.claim("test-worker", job_id)
    assert lease is not None
    if status == "done":
        services.complete([(lease, {"ok": True})])
    else:
        services.fail([(lease, "boom", True)])
    assert Job.objects.get(pk=job_id).status == status


@pytest.mark.django_db
def test_a_held_key_returns_the_live_job_as_a_duplicate(api):
    first = post(api, BODY)
    assert first.status_code == 201, first.content
    assert first.json()["duplicate"] is False
    assert first.json()["unique_key"] == "nightly-report"
    before = counts()
    again = post(api, {**BODY, "payload": {"n": 2}})
    assert again.status_code == 200
    assert again.json()["duplicate"] is True
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["payload"] == {"n": 1}
    assert counts() == before


@pytest.mark.django_db
@pytest.mark.parametrize("held_by", ["queued", "enqueue_failed", "processing"])
def test_every_live_state_holds_the_key(api, held_by):
    job_id = post(api, BODY).json()["id"]
    if held_by == "enqueue_failed":
        services.mark_enqueue_failed([job_id])
    elif held_by == "processing":
        services.claim("test-worker", job_id)
    assert Job.objects.get(pk=job_id).status == held_by
    again = post(api, BODY)
    assert (again.status_code, again.json()["id"], again.json()["duplicate"]) == (
        200,
        job_id,
        True,
    )


@pytest.mark.django_db
@pytest.mark.parametrize("end", ["done", "failed"])
def test_a_terminal_job_frees_its_key(api, end):
    first = post(api, BODY).json()["id"]
    finish(first, end)
    second = post(api, BODY)
    assert second.status_code == 201
    assert second.json()["id"] != first
    assert second.json()["duplicate"] is False


@pytest.mark.django_db
def test_keys_are_per_client(api, other):
    _, bob = other
    mine, theirs = post(api, BODY), post(bob, BODY)
    assert mine.status_code == theirs.status_code == 201
    assert mine.json()["id"] != theirs.json()["id"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "key", ["", "has space", "x" * 201, 7, ["a"]], ids=["empty", "space", "long", "int", "list"]
)
def test_a_bad_unique_key_is_400_and_writes_nothing(api, key):
    before = counts()
    r = post(api, {**BODY, "unique_key": key})
    assert r.status_code == 400
    assert "unique_key" in r.json()["errors"]
    assert counts() == before


@pytest.mark.django_db
def test_batch_items_refuse_a_unique_key(api):
    r = api.post(
        "/api/v1/jobs/batch/",
        data=json.dumps({"jobs": [BODY]}),
        content_type="application/json",
    )
    assert r.status_code == 400
    assert "jobs.0.unique_key" in r.json()["errors"]


@pytest.mark.django_db
def test_submit_from_code_dedupes_and_frees_the_key():
    with transaction.atomic():
        job, created = submit("echo", {"n": 1}, unique_key="k")
    assert created and not job.duplicate
    with transaction.atomic():
        same, created = submit("echo", {"n": 2}, unique_key="k")
    assert (same.pk, created, same.duplicate) == (job.pk, False, True)
    finish(job.pk)
    with transaction.atomic():
        fresh, created = submit("echo", {"n": 3}, unique_key="k")
    assert created and fresh.pk != job.pk
    with pytest.raises(InvalidSubmission):
        submit("echo", {}, unique_key="no spaces allowed")


@pytest.mark.django_db
def test_the_index_refuses_a_second_live_holder_even_for_raw_sql(api):
    """Not a read-then-write: the database itself refuses two live holders."""
    post(api, BODY)
    from django.db import IntegrityError

    with pytest.raises(IntegrityError, match="job_unique_key_live"), transaction.atomic():
        raw(
            "INSERT INTO jobs_job (task, payload, queue, priority, max_retries, client_id, "
            "unique_key, status, retry_count, lease_version) SELECT task, payload, queue, "
            "priority, max_retries, client_id, unique_key, 'queued', 0, 0 FROM jobs_job"
        )


@pytest.mark.django_db
def test_staff_retry_leaves_a_job_failed_while_another_holds_its_key(api):
    """A failed job's key may be taken by a newer job; retrying it must not make two
    live holders (nor a 500): it stays failed and the retry reports it skipped."""
    old = post(api, BODY).json()["id"]
    finish(old, "failed")
    new = post(api, BODY).json()["id"]
    assert services.staff_retry([old], actor="staff:ann") == []
    assert Job.objects.get(pk=old).status == "failed"
    finish(new)
    assert services.staff_retry([old], actor="staff:ann") == [old]
    assert Job.objects.get(pk=old).status == "queued"


@pytest.mark.django_db
def test_staff_retry_of_two_failed_jobs_sharing_a_key_retries_the_oldest(api):
    a = post(api, BODY).json()["id"]
    finish(a, "failed")
    b = post(api, BODY).json()["id"]
    finish(b, "failed")
    assert services.staff_retry([b, a], actor="staff:ann") == [a]
    assert Job.objects.get(pk=b).status == "failed"


@pytest.mark.django_db(transaction=True)
def test_twenty_concurrent_submissions_with_one_key_make_one_job():
    """Real connections, one per thread, released together: the partial unique index
    lets one INSERT through; the other nineteen get that job back as a duplicate.
    Once it is done, the key makes a new job."""
    client, token = new_client("unique-racer")
    n = 20

    def submit(i: int, go) -> tuple[int, int, bool]:
        api = authed(token)
        go()
        r = post(api, {**BODY, "payload": {"n": i}})
        return r.status_code, r.json()["id"], r.json()["duplicate"]

    results = race(n, submit)
    assert sorted(code for code, _, _ in results) == [200] * (n - 1) + [201]
    assert sorted(dup for _, _, dup in results) == [False] + [True] * (n - 1)
    assert len({job_id for _, job_id, _ in results}) == 1
    assert Job.objects.filter(client=client, unique_key=BODY["unique_key"]).count() == 1
    (job_id,) = {job_id for _, job_id, _ in results}
    finish(job_id)
    again = post(authed(token), BODY)
    assert again.status_code == 201 and again.json()["id"] != job_id


@pytest.mark.django_db
def test_an_idempotent_replay_must_repeat_the_unique_key_too(api):
    def keyed(body):
        return api.post(
            URL, data=json.dumps(body), content_type="application/json", HTTP_IDEMPOTENCY_KEY="i1"
        )

    first = keyed(BODY)
    assert first.status_code == 201
    assert keyed(BODY).json()["id"] == first.json()["id"]
    assert keyed({**BODY, "unique_key": "other"}).status_code == 409
    without = {k: v for k, v in BODY.items() if k != "unique_key"}
    assert keyed(without).status_code == 409
