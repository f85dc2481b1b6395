"""The worker's batched write-back, against a statement that really fails once.

Each statement of a write-back (complete, fail, release) commits on its own. When a
later one fails (a killed connection, a serialization failure), the retry must not
run the earlier ones again: they already landed, and re-running them finds the rows
changed and records the worker's own successful write as a stale one turned away.
"""

from __future__ import annotations

import threading

import pytest

from jobs import metrics, services
from jobs.models import JobEvent
from jobs.worker import Outcome, Worker
from tests.conftest import job_row
from tests.factories import JobFactory, raw

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fail_once():
    """Make the first UPDATE of one job fail for real, inside PostgreSQL."""
    raw("CREATE SEQUENCE test_fail_once")

    def arm(job_id: int) -> None:
        raw(
            f"""CREATE FUNCTION test_fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                  IF NEW.id = {int(job_id)} AND nextval('test_fail_once') = 1 THEN
                    RAISE EXCEPTION 'injected failure' USING ERRCODE = 'serialization_failure';
                  END IF;
                  RETURN NEW;
                END $$;
                CREATE TRIGGER aaa_test_fail_once BEFORE UPDATE ON jobs_job
                  FOR EACH ROW EXECUTE FUNCTION test_fail_once();"""
        )

    yield arm
    raw("DROP TRIGGER IF EXISTS aaa_test_fail_once ON jobs_job")
    raw("DROP FUNCTION IF EXISTS test_fail_once()")
    raw("DROP SEQUENCE IF EXISTS test_fail_once")


def test_retry_after_a_failed_statement_does_not_repeat_the_ones_that_landed(fail_once):
    worker = Worker(worker_id="w-batch")
    done_job, retry_job = JobFactory.create(), JobFactory.create(task="fail")
    done_lease = services.claim(worker.worker_id, done_job.pk)
    retry_lease = services.claim(worker.worker_id, retry_job.pk)
    fail_once(retry_job.pk)  # complete() lands, then fail() fails once

    worker._write_back(
        [
            Outcome(done_lease, "done", result={"ok": True}),
            Outcome(retry_lease, "fail", error="RetryableError: again"),
        ]
    )

    assert job_row(done_job.pk)["status"] == "done"
    row = job_row(retry_job.pk)
    assert (row["status"], row["retry_count"], row["lease_version"]) == ("queued", 1, 2)
    assert list(JobEvent.objects.filter(kind="fence_rejected")) == []
    assert worker.finished == 1


@pytest.fixture
def refuse():
    """Make PostgreSQL refuse, with a data error, every UPDATE of a row matching `when`."""

    def arm(when: str) -> None:
        raw(
            f"""CREATE FUNCTION test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                  IF {when} THEN
                    RAISE EXCEPTION 'value refused for job %', NEW.id
                      USING ERRCODE = 'invalid_text_representation';
                  END IF;
                  RETURN NEW;
                END $$;
                CREATE TRIGGER aaa_test_refuse BEFORE UPDATE ON jobs_job
                  FOR EACH ROW EXECUTE FUNCTION test_refuse();"""
        )

    yield arm
    raw("DROP TRIGGER IF EXISTS aaa_test_refuse ON jobs_job")
    raw("DROP FUNCTION IF EXISTS test_refuse()")


def _claimed(worker: Worker, n: int, task: str = "echo") -> list:
    return [services.claim(worker.worker_id, JobFactory.create(task=task).pk) for _ in range(n)]


@pytest.mark.timeout(30)
def test_a_result_postgres_refuses_fails_its_job_alone_and_the_batch_lands(refuse):
    """A data error is about one row: never retried as a batch (it was, forever)."""
    worker = Worker(worker_id="w-poison")
    leases = _claimed(worker, 9)
    poison = leases[6]
    refuse(f"NEW.id = {poison.job_id} AND NEW.status = 'done'")
    refused = metrics.WRITEBACK_REFUSED.labels(poison.queue, poison.task, "complete")
    refused_before = refused._value.get()

    worker._write_back([Outcome(lease, "done", result={"n": n}) for n, lease in enumerate(leases)])

    for n, lease in enumerate(leases):
        row = job_row(lease.job_id)
        if lease is poison:
            assert (row["status"], row["retry_count"]) == ("failed", 0)
            assert row["error"] == (
                f"invalid result: PostgreSQL refused it (value refused for job {poison.job_id})"
            )
            assert row["error_class"] == "django.db.utils.DataError"
        else:
            assert (row["status"], row["result"]) == ("done", {"n": n})
    assert list(JobEvent.objects.filter(kind="fence_rejected")) == []
    assert worker.finished == 9
    assert worker.inflight == 0
    assert refused._value.get() == refused_before + 1


@pytest.mark.timeout(30)
def test_error_detail_postgres_refuses_is_dropped_but_the_error_is_kept(refuse):
    """A failed attempt whose traceback cannot be stored still fails, with its message."""
    worker = Worker(worker_id="w-poison")
    leases = _claimed(worker, 3, task="fail")
    poison = leases[1]
    refuse(f"NEW.id = {poison.job_id} AND NEW.error_traceback IS NOT NULL")

    worker._write_back(
        [
            Outcome(lease, "fail", error="ValueError: café", permanent=True,
                    error_class="builtins.ValueError", traceback="Traceback ...")
            for lease in leases
        ]
    )  # fmt: skip

    for lease in leases:
        row = job_row(lease.job_id)
        assert row["status"] == "failed"
        if lease is poison:
            assert (row["error"], row["error_class"]) == ("ValueError: caf\\xe9", None)
        else:
            assert (row["error"], row["error_traceback"]) == ("ValueError: café", "Traceback ...")
    assert worker.finished == 3


def _fence_count(lease, op: str) -> float:
    return metrics.FENCE_REJECTIONS.labels(lease.queue, lease.task, op)._value.get()


@pytest.mark.timeout(30)
def test_a_newer_lease_on_the_same_job_does_not_vouch_for_the_revoked_attempt():
    """Heartbeats are matched by (job id, lease_version), D14: the same worker re-claims
    a revoked job while the old attempt still runs; that attempt must be told to stop."""
    worker = Worker(worker_id="w-again", lease_seconds=0.6)  # a heartbeat every 0.2 s
    job = JobFactory.create(task="sleep", payload={"seconds": 30})
    old = services.claim(worker.worker_id, job.pk)
    worker._start([old])
    services.revoke([job.pk], actor="staff:t")
    new = services.claim(worker.worker_id, job.pk)
    assert (old.lease_version, new.lease_version) == (1, 3)
    worker._start([new])
    contexts = {k: i.ctx for k, i in worker._inflight.items()}
    lost_before = _fence_count(old, "heartbeat")

    beater = threading.Thread(target=worker._heartbeat_loop)
    beater.start()
    try:
        stopped = contexts[(job.pk, 1)].stop.wait(5)
    finally:
        worker.halt.set()
        beater.join(5)

    assert stopped, "the revoked attempt was never told it lost the job"
    assert contexts[(job.pk, 1)].lost_authority
    assert not contexts[(job.pk, 3)].stop.is_set()
    assert _fence_count(old, "heartbeat") == lost_before + 1
    row = job_row(job.pk)
    assert (row["status"], row["lease_version"], row["owned_by"]) == ("processing", 3, "w-again")
