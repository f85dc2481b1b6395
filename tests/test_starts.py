"""Start marks against the real database (jobs.starts, D77, D78): the starter thread
writes them on its own connection, so the rows are committed (transactional_db)."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import REGISTRY

from jobs import durable, services
from jobs.lifecycle import NOT_STARTED
from jobs.models import Job
from jobs.starts import Starter, Verdict, must_wait
from tests.factories import JobFactory, raw
from tests.harness import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

W = "w-starts"


@pytest.fixture
def starter():
    halt = threading.Event()
    s = Starter(W, halt)
    s.start()
    yield s
    halt.set()
    s.join(2)


def _prefetched(max_retries: int = 3) -> services.Lease:
    """A job claimed into a prefetch buffer: not marked started by its claim."""
    job = JobFactory.create(task="echo", max_retries=max_retries)
    (lease,) = services.claim_next(W, [job.queue], 1, start=0)
    assert Job.objects.get(pk=job.pk).started_at is None
    return lease


def test_a_claim_marks_only_the_jobs_idle_threads_take():
    jobs = [JobFactory.create(task="echo", queue="marks") for _ in range(3)]
    leases = services.claim_next(W, ["marks"], 3, start=1)
    started = dict(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("id", "started_at"))
    assert [started[lease.job_id] is not None for lease in leases] == [True, False, False]
    services.claim_next(W, ["marks"], 1)  # code that claims to run at once: all marked
    assert services.claim_next(W, ["marks"], 1) == []


def test_a_last_attempt_is_marked_before_its_handler_is_called(starter):
    lease = _prefetched(max_retries=0)
    assert must_wait(lease)
    assert starter.admit(lease, durable.context(lease)) == Verdict.RUN
    assert Job.objects.get(pk=lease.job_id).started_at is not None  # on record already


def _dropped(queue: str, reason: str) -> float:
    return (
        REGISTRY.get_sample_value("jobs_attempts_dropped_total", {"queue": queue, "reason": reason})
        or 0.0
    )


def test_a_last_attempt_revoked_meanwhile_is_refused_by_the_fenced_mark(starter):
    lease = _prefetched(max_retries=0)
    before = _dropped(lease.queue, "revoked")
    services.revoke([lease.job_id], "staff:test")
    assert starter.admit(lease, durable.context(lease)) == Verdict.REVOKED
    assert Job.objects.get(pk=lease.job_id).started_at is None
    assert _dropped(lease.queue, "revoked") == before + 1


def test_a_last_attempt_cancelled_meanwhile_is_not_started(starter):
    lease = _prefetched(max_retries=0)
    services.request_cancel([lease.job_id], "staff:test")
    assert starter.admit(lease, durable.context(lease)) == Verdict.CANCELLED
    assert Job.objects.get(pk=lease.job_id).started_at is None


def test_with_budget_left_the_handler_is_called_at_once_and_the_mark_follows(starter):
    lease = _prefetched(max_retries=3)
    assert not must_wait(lease)
    assert starter.admit(lease, durable.context(lease)) == Verdict.RUN
    wait_until(lambda: Job.objects.get(pk=lease.job_id).started_at is not None, 5,
               message="the start on record")  # fmt: skip


def test_what_the_heartbeats_said_is_checked_first(starter):
    lease = _prefetched(max_retries=0)
    ctx = durable.context(lease)
    ctx.lost_authority = True
    assert starter.admit(lease, ctx) == Verdict.REVOKED
    ctx = durable.context(lease)
    ctx.request_cancel()
    assert starter.admit(lease, ctx) == Verdict.CANCELLED
    assert Job.objects.get(pk=lease.job_id).started_at is None  # no statement at all


def test_the_look_at_prefetched_leases_learns_a_revoke_and_a_cancel():
    revoked, cancelled, kept = _prefetched(), _prefetched(), _prefetched()
    waiting = [(lease, durable.context(lease)) for lease in (revoked, cancelled, kept)]
    services.revoke([revoked.job_id], "staff:test")
    services.request_cancel([cancelled.job_id], "staff:test")
    halt = threading.Event()
    s = Starter(W, halt, lambda: waiting, look_every=0.05)
    s.start()
    try:
        wait_until(lambda: waiting[0][1].lost_authority, 5, message="revoke seen")
        wait_until(lambda: waiting[1][1]._cancel_requested, 5, message="cancel seen")
    finally:
        halt.set()
        s.join(2)
    assert not waiting[2][1].lost_authority and not waiting[2][1]._cancel_requested
    assert not waiting[1][1].lost_authority


def test_crash_recovery_requeues_an_unstarted_attempt_free_and_flags_its_next_claim():
    lease = _prefetched(max_retries=0)
    raw("UPDATE jobs_job SET heartbeat_at = now() - interval '1 hour' WHERE id = %s",
        [lease.job_id])  # fmt: skip
    assert services.reap_expired(60)[lease.job_id].status == "queued"
    row = Job.objects.get(pk=lease.job_id)
    assert (row.retry_count, row.lease_version) == (0, 2)
    assert row.error.endswith(NOT_STARTED)
    (again,) = services.claim_next(W, [row.queue], 1, start=0)
    assert again.rerun and must_wait(again)


@pytest.mark.parametrize("ended", [True, False])
def test_a_mark_that_lands_after_its_attempt_ended_is_no_lost_authority(
    starter, monkeypatch, caplog, ended
):
    """A fast attempt can end, and its job be requeued for a retry (lease bumped), while
    its start mark is on its way: the fenced mark then finds the lease gone. That attempt
    lost nothing and is not told so; one still running is told to stop."""
    from jobs import starts

    lease = _prefetched(max_retries=3)
    ctx = durable.context(lease)
    real = starts.services.mark_started

    def meanwhile(leases):
        services.revoke([lease.job_id], "staff:test")  # the lease moves on in PostgreSQL
        if ended:
            starter.ended(lease)  # the worker settled the attempt before the mark landed
        return real(leases)

    monkeypatch.setattr(starts.services, "mark_started", meanwhile)
    with caplog.at_level("WARNING", logger="jobs.starts"):
        assert starter.admit(lease, ctx) == Verdict.RUN  # budget left: runs at once
        wait_until(lambda: not starter._writing and not starter._unmarked, 5,
                   message="the mark written")  # fmt: skip
    told = "lost authority over job at its start" in caplog.text
    assert (told, ctx.lost_authority, ctx.stop.is_set()) == ((False,) * 3 if ended else (True,) * 3)
