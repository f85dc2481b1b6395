"""Backpressure (SPEC §8): past JOBS_MAX_QUEUE_DEPTH queued jobs, 429 + Retry-After,
nothing written; the depth check is a bounded count served by the claim index."""

from __future__ import annotations

import json

import pytest
from django.db import connection, transaction
from prometheus_client import REGISTRY

from jobs import admission, services, submission
from jobs.models import Job
from tests.api.conftest import counts
from tests.factories import JobFactory

URL = "/api/v1/jobs/"


def post(api, queue="default", key=None):
    extra = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    body = {"task": "echo", "payload": {}, "queue": queue}
    return api.post(URL, data=json.dumps(body), content_type="application/json", **extra)


def fill(queue: str, n: int) -> list[Job]:
    return [JobFactory.create(queue=queue) for _ in range(n)]


@pytest.mark.django_db
def test_queue_past_the_limit_refuses_with_429(api, settings):
    settings.JOBS_MAX_QUEUE_DEPTH = 3
    fill("default", 4)
    rejected = REGISTRY.get_sample_value(
        "jobs_submissions_rejected_total", {"queue": "default", "code": "queue_full"}
    )
    before = counts()
    r = post(api)
    assert r.status_code == 429
    assert r["Retry-After"] == str(submission.RETRY_AFTER_SECONDS)
    assert r.json()["code"] == "queue_full"
    assert counts() == before
    after = REGISTRY.get_sample_value(
        "jobs_submissions_rejected_total", {"queue": "default", "code": "queue_full"}
    )
    assert after == (rejected or 0) + 1
    # Other queues are not held back by a full one.
    assert post(api, queue="other").status_code == 201


@pytest.mark.django_db
def test_queue_at_the_limit_still_accepts_then_refuses(api, settings):
    settings.JOBS_MAX_QUEUE_DEPTH = 3
    fill("default", 3)
    assert post(api).status_code == 201  # depth 3 is not past 3
    assert post(api).status_code == 429  # depth 4 is (known without a new count)


@pytest.mark.django_db
def test_only_queued_jobs_count(api, settings):
    settings.JOBS_MAX_QUEUE_DEPTH = 1
    JobFactory.create(status="done")
    JobFactory.create(status="failed")
    JobFactory.create(status="processing")
    JobFactory.create(status="enqueue_failed")
    assert post(api).status_code == 201


@pytest.mark.django_db
def test_depth_reading_is_cached_briefly(api, settings, monkeypatch):
    settings.JOBS_MAX_QUEUE_DEPTH = 2
    jobs = fill("default", 3)
    assert post(api).status_code == 429
    services.cancel([j.pk for j in jobs], actor="test")  # the queue drains
    assert post(api).status_code == 429  # the cached reading still says full
    admission.clear_depth_cache()
    monkeypatch.setattr(admission, "DEPTH_CACHE_SECONDS", 0.0)
    assert post(api).status_code == 201  # counted afresh: empty
    fill("default", 3)
    assert post(api).status_code == 429  # the reading expired at once: counted again


@pytest.mark.django_db
def test_idempotent_replay_is_answered_even_when_full(api, settings):
    settings.JOBS_MAX_QUEUE_DEPTH = 2
    first = post(api, key="k")
    assert first.status_code == 201
    fill("default", 3)
    admission.clear_depth_cache()  # the factory bypassed this process's reading
    again = post(api, key="k")
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert post(api, key="new").status_code == 429


@pytest.mark.django_db
def test_python_submit_raises_queue_full(settings):
    settings.JOBS_MAX_QUEUE_DEPTH = 0
    fill("default", 1)
    before = counts()
    with pytest.raises(submission.QueueFull) as exc:
        submission.submit("echo", {})
    assert exc.value.retry_after == submission.RETRY_AFTER_SECONDS
    assert counts() == before


@pytest.mark.django_db
def test_depth_count_is_bounded():
    fill("deep", 7)
    assert admission.queue_depth("deep", 2) == 3  # stops at limit + 1
    admission.clear_depth_cache()
    assert admission.queue_depth("deep", 100) == 7


@pytest.mark.django_db
def test_depth_count_is_served_by_the_partial_claim_index():
    """The query's predicate matches job_claim_idx, so Postgres can answer from it.

    On a tiny table any index on status is as cheap, so the planner's pick is a coin
    toss: inside a transaction that rolls back, every other secondary index is dropped
    and seq scans are disabled, only to show that this one applies."""
    fill("deep", 3)
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = 'jobs_job' "
            "AND indexname NOT IN ('job_claim_idx', 'jobs_job_pkey')"
        )
        for (name,) in cur.fetchall():
            cur.execute(f'DROP INDEX "{name}"')
        cur.execute("SET LOCAL enable_seqscan = off")
        cur.execute("EXPLAIN " + admission._DEPTH_SQL, ["deep", 101])
        plan = "\n".join(r[0] for r in cur.fetchall())
    assert "job_claim_idx" in plan, plan
    assert "Limit" in plan, plan
