"""Prefetch with real worker processes: jobs claimed ahead of the handler threads are
given back unrun on SIGTERM and when a long job holds the threads, are not charged a
retry by a kill -9 (only a started attempt is, D77), never call their handler once
revoked or cancelled (D78), and long jobs are claimed one thread at a time."""

from __future__ import annotations

import signal
import time

import pytest
from django.db import transaction

from jobs import selectors, services
from jobs.lifecycle import NOT_STARTED
from jobs.models import Job, JobEvent, WorkerProcess
from tests.conftest import job_row
from tests.harness import wait_until

pytestmark = pytest.mark.slow

PREFETCHED = 20
ON_LAST_ATTEMPT = 8
TASKS = "demo.tasks,tests.e2e_tasks"


def _registered(pid: int) -> bool:
    return WorkerProcess.objects.filter(pid=pid).exists()


def _warm_up(queue: str) -> None:
    """A few no-op jobs, so the worker has measured a short run time and prefetches."""
    ids = [services.submit("echo", {}, queue=queue)[0].pk for _ in range(3)]
    wait_until(
        lambda: Job.objects.filter(pk__in=ids, status="done").count() == 3, 20, message="warm"
    )


def _long_then_short(queue: str, seconds: float) -> tuple[int, list[int]]:
    """One long job ahead of PREFETCHED short ones, signalled together (one commit)."""
    with transaction.atomic():
        long_job, _ = services.submit("sleep", {"seconds": seconds}, queue=queue, priority=10)
        short = [services.submit("echo", {"n": n}, queue=queue)[0].pk for n in range(PREFETCHED)]
    return long_job.pk, short


def _held_by(owner_pid: int, ids: list[int]) -> int:
    return Job.objects.filter(
        pk__in=ids, status="processing", owned_by__contains=f":{owner_pid}:"
    ).count()


def _calls(job_id: int) -> list[int]:
    """The lease versions under which the job's handler was called."""
    from demo.models import Effect

    return sorted(Effect.objects.filter(job_id=job_id).values_list("lease_version", flat=True))


def test_sigterm_releases_prefetched_jobs_at_once_and_lets_the_running_one_finish(stack):
    # A 60 s lease: the prefetch window (4 s) and its stale release (8 s) stay out of
    # the way, so only the shutdown gives the waiting jobs back.
    w = stack.worker("--concurrency", "1", "--grace", "30", "--queues", "pf-term",
                     JOBS_LEASE_SECONDS="60")  # fmt: skip
    wait_until(lambda: _registered(w.pid), 20, message="registered")
    _warm_up("pf-term")
    long_id, short = _long_then_short("pf-term", 3)
    ids = [long_id, *short]
    wait_until(lambda: _held_by(w.pid, ids) == len(ids), 15, message="all claimed by one worker")
    assert job_row(long_id)["heartbeat_at"] is not None
    run_at = {j.pk: j.run_at for j in Job.objects.filter(pk__in=short)}
    w.signal(signal.SIGTERM)
    # Given back at once, not after the running job's 3 s.
    wait_until(
        lambda: Job.objects.filter(pk__in=short, status="queued").count() == PREFETCHED,
        2.5,
        interval=0.05,
        message="prefetched jobs released at once",
    )
    assert job_row(long_id)["status"] == "processing"
    assert w.wait(20) == 0
    assert job_row(long_id)["status"] == "done"
    for job in Job.objects.filter(pk__in=short):
        # Fenced release: lease bumped, no retry spent, its place in the queue kept.
        assert (job.status, job.retry_count, job.lease_version) == ("queued", 0, 2)
        assert job.run_at == run_at[job.pk]
        assert job.owned_by is None
        assert "released by worker shutdown" in job.error
    events = JobEvent.objects.filter(job_id__in=short, from_status="processing", to_status="queued")
    assert events.count() == PREFETCHED
    assert {e.actor.split(":")[0] for e in events} == {"worker"}
    assert "released 20 prefetched job(s) not started" in w.output()
    # Another worker runs them, each in one attempt.
    stack.worker("--concurrency", "1", "--queues", "pf-term")
    wait_until(
        lambda: Job.objects.filter(pk__in=short, status="done").count() == PREFETCHED,
        20,
        message="released jobs done elsewhere",
    )
    assert {j.retry_count for j in Job.objects.filter(pk__in=short)} == {0}


def test_jobs_waiting_behind_a_long_job_are_released_to_another_worker(stack):
    """Default lease (15 s): the prefetch window is 1 s; a prefetched job not started
    within 2 s goes back, and an idle worker runs it while the long job still runs."""
    a = stack.worker("--concurrency", "1", "--queues", "pf-stale")
    wait_until(lambda: _registered(a.pid), 20, message="registered")
    _warm_up("pf-stale")
    long_id, short = _long_then_short("pf-stale", 8)
    wait_until(lambda: _held_by(a.pid, short) >= 1, 15, interval=0.05, message="prefetched")
    b = stack.worker("--concurrency", "1", "--queues", "pf-stale")
    wait_until(
        lambda: Job.objects.filter(pk__in=short, status="done").count() == PREFETCHED,
        20,
        interval=0.1,
        message="short jobs done elsewhere",
    )
    assert job_row(long_id)["status"] == "processing"  # the long job still runs on a
    done_by = set(Job.objects.filter(pk__in=short).values_list("updated_by", flat=True))
    assert any(f":{b.pid}:" in actor for actor in done_by), done_by
    released = JobEvent.objects.filter(
        job_id__in=short, from_status="processing", to_status="queued"
    )
    assert released.exists()
    assert all("not started within 2s" in e.error for e in released)
    assert {j.retry_count for j in Job.objects.filter(pk__in=short)} == {0}
    wait_until(lambda: job_row(long_id)["status"] == "done", 20, message="long job done")


def test_kill_9_charges_only_the_started_attempt(stack):
    """One worker thread runs a job while 8 more wait in its prefetch buffer, every one
    on its last attempt (max_retries 0). kill -9: crash detection fails the running
    one (`worker gone`) and puts the 8 back unrun with no retry spent; they end done."""
    stack.reaper()
    a = stack.worker("--concurrency", "1", "--queues", "pf-kill", JOBS_LEASE_SECONDS="60")
    wait_until(lambda: _registered(a.pid), 20, message="registered")
    _warm_up("pf-kill")
    with transaction.atomic():
        running, _ = services.submit(
            "sleep", {"seconds": 30}, queue="pf-kill", priority=10, max_retries=0
        )
        waiting = [
            services.submit("echo", {"n": n}, queue="pf-kill", max_retries=0)[0].pk
            for n in range(ON_LAST_ATTEMPT)
        ]
    ids = [running.pk, *waiting]
    wait_until(lambda: _held_by(a.pid, ids) == len(ids), 15, interval=0.05, message="claimed")
    wait_until(lambda: job_row(running.pk)["started_at"] is not None, 10, message="started")
    assert Job.objects.filter(pk__in=waiting, started_at__isnull=False).count() == 0
    a.kill()
    killed_at = selectors.db_now()
    b = stack.worker("--concurrency", "4", "--queues", "pf-kill")
    wait_until(
        lambda: Job.objects.filter(pk__in=waiting, status="done").count() == ON_LAST_ATTEMPT,
        30,
        interval=0.1,
        message="the prefetched jobs done after the kill",
    )
    wait_until(lambda: job_row(running.pk)["status"] == "failed", 10, message="charged")
    charged = job_row(running.pk)
    assert charged["retry_count"] == 1
    assert charged["error"].startswith("worker gone")
    assert NOT_STARTED not in charged["error"]
    for job in Job.objects.filter(pk__in=waiting):
        # Requeued by the reaper (lease 1 -> 2), claimed and run by b (lease 3).
        assert (job.retry_count, job.lease_version) == (0, 3)
        assert f":{b.pid}:" in job.updated_by
    reaped = JobEvent.objects.filter(job_id__in=waiting, actor="reaper")
    assert reaped.count() == ON_LAST_ATTEMPT
    assert {(e.from_status, e.to_status, e.retry_count) for e in reaped} == {
        ("processing", "queued", 0)
    }
    assert all(e.error.startswith("worker gone") and NOT_STARTED in e.error for e in reaped)
    jobs = Job.objects.filter(pk__in=ids)
    recovered = (max(j.finished_at for j in jobs) - killed_at).total_seconds()
    print(f"kill -9 with {len(ids)} leases held: all ended {recovered:.2f}s after the kill")
    assert recovered < 25  # the SLO budget (SPEC §6)


@pytest.mark.parametrize("action", ["revoke", "cancel"])
def test_a_prefetched_attempt_revoked_or_cancelled_never_calls_its_handler(stack, action):
    """Default prefetch: a job waits behind a running one in the worker's buffer; staff
    revoke it (or cancel it). Its handler is never called under that lease: a revoked
    job runs once, under the newer lease of its next claim; a cancelled one never."""
    w = stack.worker("--concurrency", "1", "--queues", f"pf-{action}", JOBS_TASK_MODULES=TASKS)
    wait_until(lambda: _registered(w.pid), 20, message="registered")
    _warm_up(f"pf-{action}")
    with transaction.atomic():
        running, _ = services.submit("sleep", {"seconds": 1.5}, queue=f"pf-{action}", priority=10)
        job, _ = services.submit("e2e.record_call", {}, queue=f"pf-{action}")
    wait_until(lambda: _held_by(w.pid, [running.pk, job.pk]) == 2, 15, interval=0.02,
               message="both claimed by one worker")  # fmt: skip
    assert job_row(job.pk)["started_at"] is None
    held_lease = job_row(job.pk)["lease_version"]
    if action == "revoke":
        assert services.revoke([job.pk], "staff:test") == [job.pk]
    else:
        assert services.staff_cancel_running([job.pk], "staff:test") == [job.pk]
    wait_until(lambda: job_row(job.pk)["status"] in ("done", "failed"), 20, message="ended")
    wait_until(lambda: job_row(running.pk)["status"] == "done", 20, message="long job done")
    assert held_lease not in _calls(job.pk)
    row = job_row(job.pk)
    if action == "revoke":
        assert row["status"] == "done"
        assert _calls(job.pk) == [row["lease_version"]]  # one call, under the new lease
        assert row["retry_count"] == 0
    else:
        assert (row["status"], row["error"]) == ("failed", "cancelled")
        assert _calls(job.pk) == []
    assert f"{action}d while prefetched: not started" in w.output() or (
        action == "cancel" and "cancelled while prefetched: not started" in w.output()
    )


def test_long_jobs_are_claimed_one_thread_at_a_time(stack):
    """Two workers of 4 threads: 8 long jobs run 4 + 4 at once, first before any run
    time is known, then again once the worker has measured that jobs are long."""
    workers = [stack.worker("--queues", "pf-long", "--concurrency", "4") for _ in range(2)]
    for w in workers:
        wait_until(lambda w=w: _registered(w.pid), 20, message="registered")
    for _round in range(2):
        with transaction.atomic():
            ids = [
                services.submit("sleep", {"seconds": 2}, queue="pf-long")[0].pk for _ in range(8)
            ]
        most = dict.fromkeys((w.pid for w in workers), 0)
        deadline = time.monotonic() + 30
        while Job.objects.filter(pk__in=ids, status="done").count() < 8:
            assert time.monotonic() < deadline, "long jobs not done"
            for pid in most:
                most[pid] = max(most[pid], _held_by(pid, ids))
            time.sleep(0.05)
        assert max(most.values()) <= 4, most
        assert min(most.values()) >= 1, most  # both workers ran some
        ran_by = {j.updated_by for j in Job.objects.filter(pk__in=ids)}
        assert len(ran_by) == 2, ran_by
        assert {j.retry_count for j in Job.objects.filter(pk__in=ids)} == {0}
