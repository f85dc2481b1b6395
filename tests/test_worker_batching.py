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
    claims = JobEvent.objects.filter(job_id=victim, kind="transition", to_status="processing")
    assert claims.count() == 2
    assert (
        not JobEvent.objects.filter(job_id__in=ids, kind="fence_rejected")
        .exclude(job_id=victim)
        .exists()
    )
    assert "fence rejected stale complete" in w.output()


@pytest.mark.django_db
def test_two_attempts_of_one_job_in_one_write_back_are_told_apart():
    """A job revoked and re-claimed by the same worker while its stale result still
    waited: both results reach the flusher together; only the current lease lands."""
    from jobs.tasks import JobContext
    from jobs.worker import InFlight, Outcome, Worker

    w = Worker(concurrency=2, worker_id="w-same")
    job, _ = services.submit("echo", {})
    stale = services.claim(w.worker_id, job.pk)
    services.revoke([job.pk], actor="staff:test")
    current = services.claim(w.worker_id, job.pk)
    assert (stale.lease_version, current.lease_version) == (1, 3)
    for lease in (stale, current):
        ctx = JobContext(lease.job_id, lease.lease_version, 1, w.worker_id, "default", "echo")
        w._inflight[(lease.job_id, lease.lease_version)] = InFlight(lease, ctx, finishing=True)
    w._write_back(
        [Outcome(stale, "done", result={"from": "stale"}), Outcome(current, "done", result=2)]
    )
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.lease_version, row.result) == ("done", 3, 2)
    rejected = JobEvent.objects.get(job_id=job.pk, kind="fence_rejected")
    assert rejected.lease_version == 1
    assert w._inflight == {}


def test_flush_interval_out_of_range_is_refused(stack):
    w = stack.worker("--flush-interval", "-1")
    assert w.wait(20) != 0
    assert "--flush-interval must be between 0 and 5 seconds" in w.output()


@pytest.mark.django_db
def test_a_worker_holds_at_most_twice_its_concurrency_in_leases():
    """Finished results awaiting write-back free their handler thread but still count,
    so claims overlap the flusher without holding leases without bound."""
    from jobs.tasks import JobContext
    from jobs.worker import InFlight, Worker

    w = Worker(concurrency=3, worker_id="w-slots")
    assert w._free_slots() == 3
    leases = [services.claim(w.worker_id, services.submit("echo", {})[0].pk) for _ in range(5)]
    for n, lease in enumerate(leases):
        ctx = JobContext(lease.job_id, lease.lease_version, 1, w.worker_id, "default", "echo")
        w._inflight[(lease.job_id, lease.lease_version)] = InFlight(lease, ctx)
        w._running += 1
        if n < 3:
            w._mark_finishing(lease)
    # Two running, three awaiting write-back: one thread is free, one lease short of 2 x 3.
    assert (w._running, len(w._inflight)) == (2, 5)
    assert w._free_slots() == 1
    w._forget(leases[:3])
    assert w._free_slots() == 1  # two still running out of three threads
    w._forget(leases[3:])
    assert (w._running, w._free_slots()) == (0, 3)


@pytest.mark.django_db
def test_prefetch_follows_measured_run_times_and_stays_bounded():
    """No prefetch before a run time is measured or for jobs longer than the window
    (1/15 of the lease); short jobs fill it until running and prefetched jobs reach
    --prefetch, never past it, and a worker with as many threads prefetches none."""
    from jobs.worker import Worker

    w = Worker(concurrency=4, worker_id="w-prefetch", lease_seconds=15, prefetch=128)
    assert w.prefetch_window == 1.0
    assert (w._prefetch(), w._free_slots(w._prefetch())) == (0, 4)
    w._learn_run_time(0.0001)  # no-op jobs
    assert w._prefetch() == 124
    # Running and prefetched count against 4 + 124; write-back against twice that.
    assert w._free_slots(124) == 128
    w._running, w._waiting = 4, 100
    assert w._free_slots(124) == 24
    # A long run is learnt at once: 4 threads finish fewer than 8 jobs in 1 s.
    w._learn_run_time(3.0)
    assert w._run_time > 1.0
    assert w._prefetch() == 0
    # Jobs of 0.25 s: 4 threads finish 16 within the window, 4 of them the running ones.
    w._run_time = 0.25
    assert w._prefetch() == 12
    for concurrency, prefetch in ((4, 0), (128, 128), (200, 128)):
        other = Worker(concurrency=concurrency, worker_id="w-off", prefetch=prefetch)
        other._learn_run_time(0.0001)
        assert other._prefetch() == 0
    # Several queues: weights share claims one claim at a time, so no batches ahead.
    for served in (["a", "b"], ["*"], ["a", "*"]):
        several = Worker(served, concurrency=4, worker_id="w-several", prefetch=128)
        several._learn_run_time(0.0001)
        assert several._prefetch() == 0
    # The default worker serves `default` and the built-in `webhooks`: it prefetches.
    builtin = Worker(["default", "webhooks"], concurrency=4, worker_id="w-dflt", prefetch=128)
    builtin._learn_run_time(0.0001)
    assert builtin._prefetch() == 124


def test_prefetch_out_of_range_is_refused(stack):
    w = stack.worker("--prefetch", "-1")
    assert w.wait(20) != 0
    assert "--prefetch must be between 0 and 1000" in w.output()
