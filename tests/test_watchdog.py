"""The watchdog's rules (jobs.watchdog) with real threads, and one worker pass over a
handler thread that died without a result, against the real PostgreSQL."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from jobs import metrics, services, watchdog
from jobs.tasks import JobContext
from jobs.watchdog import Verdict
from jobs.worker import InFlight, Worker
from tests.conftest import job_row
from tests.factories import JobFactory


def finished_thread() -> threading.Thread:
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    return t


def attempt(deadline: float | None, alive: bool = True) -> SimpleNamespace:
    ctx = JobContext(1, 1, 1, "w", "default", "t")
    return SimpleNamespace(deadline=deadline, ctx=ctx, handler_alive=lambda: alive)


def test_examine_soft_then_timeout_after_the_grace_and_lost_at_once():
    soft, hard, lost, fine, none = (
        attempt(10.0),
        attempt(5.0),
        attempt(None, alive=False),
        attempt(50.0),
        attempt(None),
    )
    found = {id(i): v for i, v in watchdog.examine([soft, hard, lost, fine, none], 12.0, 5.0)}
    assert found == {id(soft): Verdict.SOFT, id(hard): Verdict.TIMEOUT, id(lost): Verdict.LOST}
    soft.ctx.time_out()  # told once: not again
    assert watchdog.examine([soft], 12.5, 5.0) == []
    assert soft.ctx.stop.is_set() and soft.ctx.timed_out


def test_the_heartbeat_renews_only_live_handlers_within_timeout_and_grace():
    assert watchdog.renewable(attempt(10.0), 14.9, 5.0)
    assert not watchdog.renewable(attempt(10.0), 15.0, 5.0)
    assert not watchdog.renewable(attempt(None, alive=False), 0.0, 5.0)
    assert watchdog.renewable(attempt(None), 1e9, 5.0)


def test_limit_is_the_jobs_else_the_tasks_else_the_default_capped(settings):
    settings.JOBS_DEFAULT_TIMEOUT, settings.JOBS_MAX_TIMEOUT = 3600, 7200
    assert watchdog.limit_seconds(5, 60) == 5
    assert watchdog.limit_seconds(None, 60) == 60
    assert watchdog.limit_seconds(None, None) == 3600
    assert watchdog.limit_seconds(10_000, None) == 7200
    settings.JOBS_DEFAULT_TIMEOUT = 0  # no default: only jobs and tasks that ask
    assert watchdog.limit_seconds(None, None) is None


@pytest.mark.django_db(transaction=True)
def test_a_handler_thread_gone_without_a_result_fails_its_attempt_and_is_replaced():
    worker = Worker(worker_id="w-watch", concurrency=1)
    job = JobFactory.create(max_retries=0)
    lease = services.claim(worker.worker_id, job.pk)
    item = InFlight(lease, JobContext(job.pk, lease.lease_version, 1, "w-watch", "default", "x"))
    item.running_since, item.thread = 0.0, finished_thread()
    worker._inflight[(lease.job_id, lease.lease_version)] = item
    worker._running = 1
    before = metrics.ATTEMPTS_ENDED_BY_WATCHDOG.labels("default", lease.task, "lost_handler")
    counted = before._value.get()

    assert not watchdog.renewable(item, 0.0, worker.timeout_grace)
    worker._watch_once(1.0)
    assert item.abandoned and worker._running == 0 and len(worker._handlers) == 1
    worker._write_back([worker._outcomes.get_nowait()])

    row = job_row(job.pk)
    assert row["status"] == "failed"
    assert row["error"] == f"handler lost: handler thread {item.thread.name} ended without a result"
    assert row["error_class"] == "jobs.watchdog.HandlerLost"
    assert before._value.get() == counted + 1
    assert worker._inflight == {}
    worker.halt.set()
    worker._ready.put(None)
