"""Heartbeat answers are matched by lease, not by job (D14, D27), with a real worker.

A staff revoke requeues a running job and the same worker claims it again: it now
runs two attempts of one job. The old attempt's heartbeat is refused; before the
fix the new lease's answer (same job id) vouched for it, so it never saw ctx.stop
and ran to its end.
"""

from __future__ import annotations

import time

import pytest

from jobs import services
from jobs.models import JobEvent
from tests.conftest import job_row
from tests.harness import wait_until

pytestmark = pytest.mark.slow


def test_the_revoked_attempt_stops_when_its_worker_holds_the_job_again(stack):
    job, _ = services.submit("sleep", {"seconds": 30})
    worker = stack.worker("--concurrency", "2", JOBS_LEASE_SECONDS="3")  # heartbeat every 1 s
    wait_until(lambda: job_row(job.pk)["status"] == "processing", 15, message="claimed")
    assert services.revoke([job.pk], actor="staff:t") == [job.pk]
    wait_until(
        lambda: job_row(job.pk)["lease_version"] == 3, 15, message="re-claimed by the worker"
    )
    revoked_at = time.monotonic()
    claims = JobEvent.objects.filter(job_id=job.pk, to_status="processing").order_by("id")
    assert [c.lease_version for c in claims] == [1, 3]
    assert claims[0].actor == claims[1].actor  # the same worker holds it again
    # The old attempt is told to stop at its next heartbeat; its late fail is fenced off.
    wait_until(
        lambda: JobEvent.objects.filter(job_id=job.pk, kind="fence_rejected").exists(),
        10,
        message="the revoked attempt stopped and its write was refused",
    )
    stopped = time.monotonic() - revoked_at
    print(f"\nrevoked attempt stopped {stopped:.1f}s after the re-claim (heartbeat every 1 s)")
    rejected = JobEvent.objects.get(job_id=job.pk, kind="fence_rejected")
    assert rejected.lease_version == 1 and "stale fail rejected" in rejected.error
    assert "lost authority over job" in worker.output()
    row = job_row(job.pk)
    assert (row["status"], row["lease_version"], row["retry_count"]) == ("processing", 3, 0)
