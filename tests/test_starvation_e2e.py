"""A job whose Redis signal was lost is not starved by a steady backlog (SPEC §5)."""

from __future__ import annotations

import time

import pytest

from jobs import services
from jobs.models import Job
from jobs.transport import get_transport
from tests.conftest import job_row
from tests.harness import wait_until

pytestmark = pytest.mark.slow

LOST_SIGNAL = 2.0
SWEEP = 1.0
RUN = 0.15


def test_job_with_a_lost_signal_runs_during_a_steady_backlog(stack):
    """Jobs arrive faster than one worker finishes them, so the Redis list never
    empties; one job's id is removed from it. It is done within
    JOBS_LOST_SIGNAL_SECONDS + a sweep + its run time (+ the backlog ahead of it)."""
    stack.reaper("--interval", str(SWEEP), JOBS_LOST_SIGNAL_SECONDS=str(LOST_SIGNAL))
    stack.worker("--concurrency", "1")
    client = get_transport()._client
    key = get_transport().key("default")
    backlog = []

    def submit_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            backlog.append(services.submit("sleep", {"seconds": RUN})[0].pk)
            time.sleep(0.08)  # ~12 jobs/s against ~6/s of capacity

    submit_for(1.0)
    lost, _ = services.submit("sleep", {"seconds": RUN})
    assert client.lrem(key, 0, lost.pk) == 1
    submitted = time.monotonic()
    done_after = None
    while time.monotonic() - submitted < 12:
        submit_for(0.25)
        assert client.llen(key) > 0  # the backlog is steady: the list never empties
        if done_after is None and job_row(lost.pk)["status"] == "done":
            done_after = time.monotonic() - submitted
            break
    ahead = Job.objects.filter(pk__lt=lost.pk, pk__in=backlog).count()
    print(f"lost-signal job done {done_after}s after submission, {ahead} backlog job(s) ahead")
    assert done_after is not None, "starved behind the backlog"
    # LOST_SIGNAL + SWEEP + RUN, plus the ~1 s of backlog submitted before it and slack
    # for a loaded machine.
    assert done_after <= LOST_SIGNAL + SWEEP + RUN + 1.0 + 3.0
    wait_until(
        lambda: not Job.objects.filter(status="queued").exists(),
        60,
        interval=0.2,
        message="backlog drained",
    )
