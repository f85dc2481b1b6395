"""Reaper sweeps in-process against real PostgreSQL and a private Redis (SPEC §5)."""

from __future__ import annotations

import pytest
from django.test import override_settings

from jobs import services
from jobs.reaper import Reaper
from tests.conftest import job_row
from tests.factories import JobFactory, raw

pytestmark = pytest.mark.django_db(transaction=True)

PREFIX = "reaper-test:"


@pytest.fixture
def redis_on(private_redis):
    with override_settings(REDIS_URL=private_redis.url, JOBS_REDIS_PREFIX=PREFIX):
        yield private_redis


def llen(server, queue="default") -> int:
    return int(server.cli("LLEN", f"{PREFIX}q:{queue}"))


def age(job_id: int, seconds: float) -> None:
    """Move a queued job's clocks back, as if it had waited `seconds` (same-status update)."""
    raw(
        "UPDATE jobs_job SET run_at = run_at - %s * interval '1 second', "
        "created_at = created_at - %s * interval '1 second' WHERE id = %s",
        [seconds, seconds, job_id],
    )


def test_lost_signals_are_resent_only_when_the_list_is_empty(redis_on):
    ids = [JobFactory.create().pk for _ in range(30)]
    assert llen(redis_on) == 30
    redis_on.flushall()
    reaper = Reaper(interval=1, lease=15, lost_signal_after=0.5)
    import time

    time.sleep(0.6)
    report = reaper.sweep()
    assert report.lost_signal == 30 and llen(redis_on) == 30
    popped = redis_on.cli("LRANGE", f"{PREFIX}q:default", "0", "-1").split()
    assert sorted(map(int, popped)) == sorted(ids)
    # Signals pending: a second sweep adds nothing.
    assert reaper.sweep().lost_signal == 0 and llen(redis_on) == 30


def test_fresh_queued_jobs_are_not_resignalled(redis_on):
    JobFactory.create()
    redis_on.flushall()
    report = Reaper(interval=1, lease=15, lost_signal_after=60).sweep()
    assert report.lost_signal == 0 and llen(redis_on) == 0


def test_scheduled_job_is_signalled_when_it_comes_due(redis_on):
    reaper = Reaper(interval=1, lease=15, lost_signal_after=60)
    reaper.sweep()
    job, _ = services.submit("echo", {}, run_at=None)
    redis_on.flushall()
    # Scheduled 0.3 s ahead: not signalled at submission, signalled by the sweep after.
    sched = raw("SELECT now() + interval '300 milliseconds'")[0][0]
    later, _ = services.submit("echo", {"s": 1}, run_at=sched)
    assert llen(redis_on) == 0
    assert reaper.sweep().came_due == 0
    import time

    time.sleep(0.4)
    report = reaper.sweep()
    assert report.came_due == 1
    assert redis_on.cli("LRANGE", f"{PREFIX}q:default", "0", "-1").split() == [str(later.pk)]
    assert job_row(job.pk)["status"] == "queued"


def test_expired_lease_requeued_and_resignalled(redis_on):
    job = JobFactory.create(status="processing")
    redis_on.flushall()
    raw("UPDATE jobs_job SET heartbeat_at = now() - interval '20 seconds' WHERE id = %s", [job.pk])
    report = Reaper(interval=1, lease=15).sweep()
    assert report.lease_requeued == 1
    row = job_row(job.pk)
    assert (row["status"], row["retry_count"], row["lease_version"], row["owned_by"]) == (
        "queued",
        1,
        2,
        None,
    )
    assert redis_on.cli("LRANGE", f"{PREFIX}q:default", "0", "-1").split() == [str(job.pk)]


def test_enqueue_failed_repaired_and_resignalled(redis_on):
    job = JobFactory.create(status="enqueue_failed")
    redis_on.flushall()
    report = Reaper(interval=1, lease=15).sweep()
    assert report.repaired == 1 and job_row(job.pk)["status"] == "queued"
    assert redis_on.cli("LRANGE", f"{PREFIX}q:default", "0", "-1").split() == [str(job.pk)]


def test_repair_with_redis_down_leaves_job_queued_not_parked(private_redis):
    with override_settings(REDIS_URL=private_redis.url, JOBS_REDIS_PREFIX=PREFIX):
        job = JobFactory.create(status="enqueue_failed")
        private_redis.stop()
        report = Reaper(interval=1, lease=15).sweep()
    assert report.repaired == 1 and job_row(job.pk)["status"] == "queued"


def test_over_budget_queued_job_is_failed(redis_on):
    job = JobFactory.create(max_retries=1)
    raw("UPDATE jobs_job SET retry_count = 2 WHERE id = %s", [job.pk])
    assert Reaper(interval=1, lease=15).sweep().over_budget == 1
    assert job_row(job.pk)["status"] == "failed"


def test_reaper_without_redis_still_recovers_leases():
    with override_settings(REDIS_URL=""):
        job = JobFactory.create(status="processing")
        raw(
            "UPDATE jobs_job SET heartbeat_at = now() - interval '1 minute' WHERE id = %s", [job.pk]
        )
        report = Reaper(interval=1, lease=15).sweep()
    assert report.lease_requeued == 1 and report.lost_signal == 0


def test_runreaper_once_says_what_each_count_counts(redis_on):
    """It printed `sweep: 0 of gone workers, ...`."""
    import io
    import re

    from django.core.management import call_command

    job = JobFactory.create(status="processing")
    raw("UPDATE jobs_job SET heartbeat_at = now() - interval '20 seconds' WHERE id = %s", [job.pk])
    out = io.StringIO()
    call_command("runreaper", "--once", "--lease", "15", stdout=out)
    assert re.fullmatch(
        r"sweep in \d+\.\d{3}s: 0 job\(s\) of gone workers requeued, 1 requeued and 0 failed "
        r"\(expired lease\), 0 repaired, 0 over budget, 0 came due, \d+ re-signalled\n",
        out.getvalue(),
    ), out.getvalue()
