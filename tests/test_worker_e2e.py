"""The worker as a real process against real PostgreSQL and Redis (SPEC §1, §3, §4)."""

from __future__ import annotations

import signal
import time

import pytest
from django.db import connection

from demo.models import Effect
from jobs import services
from jobs.models import Job, JobEvent, WorkerProcess
from tests.conftest import job_row
from tests.harness import free_port, wait_until

pytestmark = pytest.mark.slow


def statuses(ids) -> dict[int, str]:
    return dict(Job.objects.filter(pk__in=ids).values_list("pk", "status"))


def all_terminal(ids) -> bool:
    return set(statuses(ids).values()) <= {"done", "failed"}


def claims_per_job(ids) -> dict[int, int]:
    out = dict.fromkeys(ids, 0)
    for e in JobEvent.objects.filter(job_id__in=ids, to_status="processing"):
        out[e.job_id] += 1
    return out


def test_builtin_tasks_run_end_to_end(stack):
    echo, _ = services.submit("echo", {"hello": "world"})
    nap, _ = services.submit("sleep", {"seconds": 0.2})
    bad, _ = services.submit("fail", {"message": "always"}, max_retries=1)
    w = stack.worker("--concurrency", "3", JOBS_RETRY_BACKOFF_BASE="0.1")
    ids = [echo.pk, nap.pk, bad.pk]
    wait_until(lambda: all_terminal(ids), 20, message="all terminal")
    assert job_row(echo.pk)["result"] == {"hello": "world"}
    assert job_row(nap.pk)["status"] == "done" and job_row(nap.pk)["result"]["slept"] >= 0.2
    row = job_row(bad.pk)
    assert (row["status"], row["retry_count"]) == ("failed", 2)
    assert row["error"] == "RetryableError: always"
    assert claims_per_job([bad.pk]) == {bad.pk: 2}
    w.signal(signal.SIGTERM)
    assert w.wait(15) == 0


def test_redis_unreachable_for_the_whole_run_jobs_complete_by_polling(stack):
    closed = f"redis://127.0.0.1:{free_port()}/0"
    stack.env["REDIS_URL"] = closed
    ids = [services.submit("echo", {"n": i})[0].pk for i in range(30)]
    stack.worker("--concurrency", "4")
    wait_until(lambda: all_terminal(ids), 30, message="all done without redis")
    assert set(statuses(ids).values()) == {"done"}
    assert set(claims_per_job(ids).values()) == {1}


def test_redis_flushed_mid_run_loses_nothing(stack, private_redis):
    stack.env["REDIS_URL"] = private_redis.url
    from django.test import override_settings

    with override_settings(
        REDIS_URL=private_redis.url, JOBS_REDIS_PREFIX=stack.env["JOBS_REDIS_PREFIX"]
    ):
        ids = [services.submit("sleep", {"seconds": 0.05})[0].pk for i in range(200)]
        assert int(private_redis.cli("LLEN", f"{stack.env['JOBS_REDIS_PREFIX']}q:default")) == 200
        stack.worker("--concurrency", "2")
        wait_until(
            lambda: Job.objects.filter(pk__in=ids, status="done").count() >= 10,
            20,
            message="some progress",
        )
        private_redis.flushall()
        wait_until(lambda: all_terminal(ids), 60, message="all done after flush")
    assert set(statuses(ids).values()) == {"done"}


def test_each_id_pushed_three_times_runs_once(stack):
    ids = [services.submit("demo.record", {})[0].pk for _ in range(40)]
    services.push_now_ignoring_rollback([(i, "default") for i in ids] * 2)  # 3 signals each
    stack.worker("--concurrency", "4")
    wait_until(lambda: all_terminal(ids), 30, message="all done")
    assert set(claims_per_job(ids).values()) == {1}
    assert Effect.objects.filter(job_id__in=ids).count() == 40


def test_stale_worker_paused_past_its_lease_is_fenced_off(stack):
    job, _ = services.submit("demo.record", {"seconds": 2.5})
    first = stack.worker("--concurrency", "1", JOBS_LEASE_SECONDS="1")
    wait_until(lambda: job_row(job.pk)["status"] == "processing", 15, message="claimed")
    first_owner = job_row(job.pk)["owned_by"]
    first.signal(signal.SIGSTOP)
    wait_until(lambda: services.reap_expired(1.0), 10, message="lease expired and reaped")
    row = job_row(job.pk)
    assert (row["status"], row["retry_count"], row["lease_version"]) == ("queued", 1, 2)
    second = stack.worker("--concurrency", "1", JOBS_LEASE_SECONDS="1")
    wait_until(lambda: job_row(job.pk)["status"] == "done", 20, message="second worker done")
    first.signal(signal.SIGCONT)
    wait_until(
        lambda: JobEvent.objects.filter(job_id=job.pk, kind="fence_rejected").exists(),
        15,
        message="stale write rejected",
    )
    row = job_row(job.pk)
    assert row["status"] == "done" and row["lease_version"] == 3
    assert row["result"]["recorded_by"] != first_owner
    effects = list(Effect.objects.filter(job_id=job.pk))
    assert len(effects) == 1 and effects[0].lease_version == 3
    rejection = JobEvent.objects.get(job_id=job.pk, kind="fence_rejected")
    assert rejection.actor == f"worker:{first_owner}" and rejection.lease_version == 1
    second.signal(signal.SIGTERM)


def test_job_three_times_longer_than_the_lease_completes_once_without_reap(stack):
    job, _ = services.submit("sleep", {"seconds": 3.0})
    stack.worker("--concurrency", "1", JOBS_LEASE_SECONDS="1")
    stack.reaper("--interval", "0.2", "--lease", "1")
    wait_until(lambda: job_row(job.pk)["status"] == "done", 20, message="done")
    row = job_row(job.pk)
    assert (row["retry_count"], row["lease_version"]) == (0, 1)
    assert claims_per_job([job.pk]) == {job.pk: 1}
    assert not JobEvent.objects.filter(job_id=job.pk, actor="reaper").exists()


def test_sigterm_releases_running_job_within_grace_and_it_completes_later(stack):
    job, _ = services.submit("sleep", {"seconds": 4})
    w = stack.worker("--concurrency", "1", "--grace", "0.5")
    wait_until(lambda: job_row(job.pk)["status"] == "processing", 15, message="claimed")
    sent = time.monotonic()
    w.signal(signal.SIGTERM)
    assert w.wait(10) == 0
    assert time.monotonic() - sent < 4, "worker waited for the job instead of releasing it"
    row = job_row(job.pk)
    assert (row["status"], row["retry_count"], row["lease_version"]) == ("queued", 0, 2)
    stack.worker("--concurrency", "1")
    wait_until(lambda: job_row(job.pk)["status"] == "done", 20, message="completed later")


def test_sigterm_lets_short_job_finish(stack):
    job, _ = services.submit("sleep", {"seconds": 1})
    w = stack.worker("--concurrency", "1", "--grace", "10")
    wait_until(lambda: job_row(job.pk)["status"] == "processing", 15, message="claimed")
    w.signal(signal.SIGTERM)
    assert w.wait(15) == 0
    assert job_row(job.pk)["status"] == "done"


def test_second_signal_exits_at_once(stack):
    job, _ = services.submit("sleep", {"seconds": 30})
    w = stack.worker("--concurrency", "1", "--grace", "30")
    wait_until(lambda: job_row(job.pk)["status"] == "processing", 15, message="claimed")
    w.signal(signal.SIGTERM)
    time.sleep(0.3)
    sent = time.monotonic()
    w.signal(signal.SIGTERM)
    assert w.wait(5) == 130
    assert time.monotonic() - sent < 2
    assert job_row(job.pk)["status"] == "processing"  # left for the reaper


def test_second_signal_still_runs_cleanup(stack):
    """The cold stop raises in the main thread instead of os._exit, so `finally` blocks
    run: the worker unregisters (its jobs_worker row goes) on the way out."""
    job, _ = services.submit("sleep", {"seconds": 30})
    w = stack.worker("--concurrency", "1", "--grace", "30")
    wait_until(lambda: job_row(job.pk)["status"] == "processing", 15, message="claimed")
    owner = job_row(job.pk)["owned_by"]
    assert WorkerProcess.objects.filter(pk=owner).exists()
    w.signal(signal.SIGTERM)
    time.sleep(0.3)
    w.signal(signal.SIGTERM)
    assert w.wait(5) == 130
    assert not WorkerProcess.objects.filter(pk=owner).exists()
    assert job_row(job.pk)["status"] == "processing"  # still left for the reaper


def test_burst_and_max_jobs(stack):
    ids = [services.submit("echo", {"n": i})[0].pk for i in range(5)]
    w = stack.worker("--max-jobs", "2", "--concurrency", "1")
    assert w.wait(20) == 0
    assert Job.objects.filter(pk__in=ids, status="done").count() == 2
    w = stack.worker("--burst", "--concurrency", "2")
    assert w.wait(20) == 0
    assert set(statuses(ids).values()) == {"done"}


def test_postgres_connection_killed_worker_recovers(stack):
    w = stack.worker("--concurrency", "2")
    first = [services.submit("echo", {"n": i})[0].pk for i in range(5)]
    wait_until(lambda: all_terminal(first), 20, message="first batch")
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        assert cur.fetchone()[0] >= 1
    second = [services.submit("echo", {"n": i})[0].pk for i in range(5)]
    wait_until(lambda: all_terminal(second), 30, message="second batch after kill")
    assert w.alive()


def test_bad_arguments_are_refused(stack):
    w = stack.worker("--concurrency", "0")
    assert w.wait(20) != 0
    assert "--concurrency must be at least 1" in w.output()


def test_a_default_worker_runs_eight_threads_and_a_process_pool_four_children(stack):
    """D395: --concurrency left out means 8 handler threads (they mostly wait on a
    flushed commit or a handler's I/O), and 4 children with --pool processes."""
    threads = stack.worker()
    wait_until(
        lambda: WorkerProcess.objects.filter(concurrency=8).exists(), 20, message="registered"
    )
    ids = [services.submit("sleep", {"seconds": 1.0})[0].pk for _ in range(8)]
    # Eight one-second jobs on one worker: all started and running together.
    wait_until(
        lambda: (
            Job.objects.filter(pk__in=ids, status="processing", started_at__isnull=False).count()
            == 8
        ),
        20,
        message="eight running at once",
    )
    threads.signal(signal.SIGTERM)
    assert threads.wait(20) == 0
    children = stack.worker("--pool", "processes")
    wait_until(lambda: WorkerProcess.objects.filter(concurrency=4).exists(), 30, message="pool up")
    children.signal(signal.SIGTERM)
    assert children.wait(30) == 0
    assert set(statuses(ids).values()) == {"done"}
