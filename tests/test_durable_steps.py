"""Steps and waits through the worker's own execute and write-back paths, in process,
against the real database: replay, limits, refusals, parking without a retry."""

from __future__ import annotations

import time

import pytest

import tests.durable_tasks  # noqa: F401 - registers the durable test tasks
from jobs import durable, selectors, services
from jobs.models import Job, JobEvent, JobStep
from jobs.worker import OutcomeKind, Worker
from tests.durable_tasks import runs

pytestmark = pytest.mark.django_db(transaction=True)


def run_once(job_id: int, worker_id: str = "w-durable") -> OutcomeKind | None:
    """Claim the job and run one attempt as a worker does, writing its outcome back."""
    worker = Worker(worker_id=worker_id)
    lease = services.claim(worker_id, job_id)
    if lease is None:
        return None
    outcome = worker._execute(lease, durable.context(lease))
    if outcome.kind != OutcomeKind.SETTLED:
        worker._write_back_unique([outcome])
    return outcome.kind


def test_steps_per_job_are_observed_when_an_attempt_ends(tmp_path):
    from jobs import metrics

    def count() -> float:
        return sum(b.get() for b in metrics.STEPS_PER_JOB.labels("durable.five_steps")._buckets)

    before = count()
    job, _ = services.submit("durable.five_steps", {"dir": str(tmp_path)})
    lease = services.claim("w-obs", job.pk)
    Worker(worker_id="w-obs")._run_one(lease, durable.context(lease))
    assert count() == before + 1


def test_a_later_attempt_replays_committed_steps_without_running_them(tmp_path):
    job, _ = services.submit("durable.five_steps", {"dir": str(tmp_path)})
    lease = services.claim("w-a", job.pk)
    ctx = durable.context(lease)
    assert ctx.step("s1", lambda: {"n": (1, 2)}) == {"n": [1, 2]}  # as stored: JSON
    services.release([lease])  # the attempt ends without finishing
    assert run_once(job.pk) == OutcomeKind.DONE
    job.refresh_from_db()
    assert job.status == "done" and job.result["s1"] == {"n": [1, 2]}  # not run again
    assert runs(str(tmp_path), "step1") == 0
    assert [runs(str(tmp_path), f"step{n}") for n in range(2, 6)] == [1, 1, 1, 1]


def test_step_limit_fails_the_job_clearly(settings):
    settings.JOBS_MAX_STEPS = 5
    job, _ = services.submit("durable.many_steps", {"steps": 6})
    assert run_once(job.pk) == OutcomeKind.FAIL
    job.refresh_from_db()
    assert job.status == "failed" and job.retry_count == 0  # permanent: no retry spent
    assert "step limit reached: a run may have at most 5 steps" in job.error
    assert JobStep.objects.filter(job_id=job.pk).count() == 5


@pytest.mark.parametrize("kind,why", [("nan", "not JSON"), ("nul", "NUL")], ids=["nan", "nul"])
def test_a_step_result_postgres_cannot_store_fails_the_job(kind, why):
    job, _ = services.submit("durable.bad_step", {"kind": kind})
    assert run_once(job.pk) == OutcomeKind.FAIL
    job.refresh_from_db()
    assert job.status == "failed" and "step 'bad' result cannot be stored" in job.error
    assert why in job.error
    assert list(JobStep.objects.filter(job_id=job.pk).values_list("name", flat=True)) == ["ok"]


def test_step_names_are_unique_within_a_run():
    job, _ = services.submit("echo", {})
    ctx = durable.context(services.claim("w-u", job.pk))
    ctx.step("a", lambda: 1)
    with pytest.raises(durable.StepError, match="used twice"):
        ctx.step("a", lambda: 2)
    with pytest.raises(durable.StepError, match="reserved"):
        ctx.step("~sleep:1", lambda: 2)


def test_a_checkpoint_under_a_stale_lease_is_refused_and_recorded():
    job, _ = services.submit("echo", {})
    lease = services.claim("w-old", job.pk)
    ctx = durable.context(lease)
    services.revoke([job.pk], actor="staff:t")
    with pytest.raises(durable.FencedOff):
        ctx.step("late", lambda: 1)
    assert not JobStep.objects.filter(job_id=job.pk).exists()
    assert ctx.lost_authority and ctx.stop.is_set()
    event = JobEvent.objects.get(job_id=job.pk, kind="fence_rejected")
    assert "stale step rejected" in event.error


def test_durable_sleep_parks_without_spending_a_retry(tmp_path):
    from jobs import metrics

    parked = metrics.PARKED.labels("sleep")._value.get()
    job, _ = services.submit("durable.sleeper", {"dir": str(tmp_path), "seconds": 2})
    assert run_once(job.pk) == OutcomeKind.SETTLED
    assert metrics.PARKED.labels("sleep")._value.get() == parked + 1
    job.refresh_from_db()
    assert (job.status, job.retry_count, job.lease_version) == ("queued", 0, 2)
    assert job.wait_reason == "sleep" and job.owned_by is None
    steps = dict(JobStep.objects.filter(job_id=job.pk).values_list("name", "result"))
    assert set(steps) == {"before", "~sleep:1"}
    assert abs((job.run_at - job.due_at).total_seconds()) < 0.01  # the SLO clock waits too
    assert run_once(job.pk) is None  # not due: not claimable
    # Made due early (by hand here): the replay parks again until the stored deadline.
    Job.objects.filter(pk=job.pk).update(run_at=job.run_at.replace(year=2000))
    assert run_once(job.pk) == OutcomeKind.SETTLED
    assert Job.objects.get(pk=job.pk).run_at == job.run_at
    time.sleep(max(0.0, (job.run_at - selectors.db_now()).total_seconds()) + 0.05)
    assert run_once(job.pk) == OutcomeKind.DONE
    job.refresh_from_db()
    assert job.status == "done" and job.wait_reason is None
    assert runs(str(tmp_path), "before") == 1 and runs(str(tmp_path), "after") == 1


def test_a_step_inside_a_transaction_is_refused():
    from django.db import transaction

    job, _ = services.submit("echo", {})
    ctx = durable.context(services.claim("w-tx", job.pk))
    with pytest.raises(durable.StepError, match="inside a transaction"), transaction.atomic():
        ctx.step("a", lambda: 1)
    assert not JobStep.objects.filter(job_id=job.pk).exists()
