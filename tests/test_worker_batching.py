"""Batched write-back through a real worker: one stale entry is rejected alone (SPEC §3)."""

from __future__ import annotations

import pytest

from jobs import services
from jobs.models import Job, JobEvent
from tests.harness import wait_until

pytestmark = pytest.mark.slow


def test_flusher_batch_with_one_revoked_job_lands_the_others_and_rejects_only_it(stack):
    ids = [services.submit("sleep", {"seconds": 2.0})[0].pk for _ in range(8)]
    # A flush interval long enough that all eight results share one write-back.
    w = stack.worker("--concurrency", "8", "--flush-interval", "0.5")
    wait_until(
        lambda: Job.objects.filter(pk__in=ids, status="processing").count() == 8,
        20,
        message="all eight claimed",
    )
    victim = ids[3]
    owner = Job.objects.get(pk=victim).owned_by
    assert services.revoke([victim], actor="staff:test") == [victim]
    wait_until(
        lambda: Job.objects.filter(pk__in=ids, status="done").count() == 8,
        30,
        message="all done (the victim after a second run)",
    )
    others = Job.objects.filter(pk__in=ids).exclude(pk=victim)
    assert {(j.lease_version, j.retry_count) for j in others} == {(1, 0)}
    # One statement wrote the seven: the same transaction time, the same worker.
    assert len({j.finished_at for j in others}) == 1
    assert {j.updated_by for j in others} == {f"worker:{owner}"}
    rejected = JobEvent.objects.get(job_id=victim, kind="fence_rejected")
    assert rejected.lease_version == 1 and rejected.actor == f"worker:{owner}"
    assert "held lease 1, row is at lease" in rejected.error
    again = Job.objects.get(pk=victim)
    assert (again.status, again.lease_version) == ("done", 3)
    assert JobEvent.objects.filter(job_id=victim, to_status="processing").count() == 2
    assert (
        not JobEvent.objects.filter(job_id__in=ids, kind="fence_rejected")
        .exclude(job_id=victim)
        .exists()
    )
    assert "fence rejected stale complete" in w.output()
