"""Cancelling from Python (`jobs.cancelling.cancel`, `TaskResult.cancel()`) with the API's
semantics, against real rows: not started → failed at once; running → a request the
worker's next heartbeat reads; finished → refused with its status, nothing written."""

from __future__ import annotations

import pytest

from jobs import services
from jobs.backends import JobTaskResult
from jobs.cancelling import CancelOutcome, NotCancellable, cancel
from jobs.models import Job, JobEvent
from jobs.tasks_compat import TaskResultDoesNotExist, TaskResultStatus, task_backends
from tests.factories import ClientFactory, JobFactory
from tests.tasks_app import tasks as app

pytestmark = pytest.mark.django_db


def events(job_id: int) -> list[tuple]:
    return list(
        JobEvent.objects.filter(job_id=job_id)
        .order_by("id")
        .values_list("kind", "from_status", "to_status", "actor")
    )


@pytest.mark.parametrize("state", ["queued", "enqueue_failed"])
@pytest.mark.parametrize("by", [lambda j: j, lambda j: j.pk, lambda j: str(j.pk)])
def test_a_job_not_started_is_failed_cancelled_at_once(state, by):
    job = JobFactory.create(status=state)
    assert cancel(by(job)) == CancelOutcome.CANCELLED == "cancelled"
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.error, row.updated_by) == ("failed", "cancelled", "app")
    assert events(job.pk)[-1] == ("transition", state, "failed", "app")


def test_a_running_job_gets_a_request_its_worker_reads_at_the_next_heartbeat():
    job, _ = services.submit("echo", {})
    lease = services.claim("w-1", job.pk)
    assert cancel(job.pk, actor="app:billing") == CancelOutcome.REQUESTED
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.owned_by, row.lease_version) == ("processing", "w-1", 1)
    assert row.cancel_requested_at is not None
    assert events(job.pk)[-1] == ("cancel_requested", "processing", "processing", "app:billing")
    assert services.heartbeat([lease]).cancel_requested == {(job.pk, 1)}
    assert cancel(job.pk) == CancelOutcome.REQUESTED  # asked again: the first time is kept
    assert Job.objects.get(pk=job.pk).cancel_requested_at == row.cancel_requested_at


@pytest.mark.parametrize("state", ["done", "failed"])
def test_a_finished_job_is_refused_with_its_status_and_nothing_written(state):
    job = JobFactory.create(status=state)
    before = events(job.pk)
    with pytest.raises(NotCancellable) as refused:
        cancel(job)
    assert (refused.value.status, refused.value.job_id, refused.value.code) == (
        state,
        job.pk,
        "not_cancellable",
    )
    assert str(refused.value) == f"job {job.pk} is {state}; a finished job cannot be cancelled"
    assert Job.objects.get(pk=job.pk).status == state and events(job.pk) == before


def test_an_unknown_job_or_another_clients_job_does_not_exist():
    acme, other = ClientFactory.create(name="acme"), ClientFactory.create(name="other")
    job, _ = services.submit("echo", {}, client_id=acme.pk)
    with pytest.raises(Job.DoesNotExist):
        cancel(job.pk + 1000)
    with pytest.raises(Job.DoesNotExist):
        cancel(job, client=other)
    assert Job.objects.get(pk=job.pk).status == "queued"
    assert cancel(job, client=acme) == CancelOutcome.CANCELLED
    assert events(job.pk)[-1][3] == "client:acme"  # as the API records its client


@pytest.mark.parametrize("value", [None, True, "abc", -3, 1.5])
def test_what_is_not_a_job_is_a_type_error(value):
    with pytest.raises(TypeError, match="not a job"):
        cancel(value)


def test_a_task_result_cancels_and_refreshes_itself():
    result = app.add.enqueue(2, b=3)
    assert isinstance(result, JobTaskResult) and result.status == TaskResultStatus.READY
    assert result.cancel() == CancelOutcome.CANCELLED
    assert result.status == TaskResultStatus.FAILED and result.is_finished
    with pytest.raises(NotCancellable, match="is failed"):
        result.cancel()
    again = app.add.get_result(result.id)  # read back: the same class, the same state
    assert isinstance(again, JobTaskResult) and again.status == TaskResultStatus.FAILED


def test_a_running_task_result_stays_running_until_its_worker_stops_it():
    result = app.add.enqueue(1, b=1)
    lease = services.claim("w-2", int(result.id))
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING
    assert result.cancel() == CancelOutcome.REQUESTED
    assert result.status == TaskResultStatus.RUNNING
    assert services.heartbeat([lease]).cancel_requested == {(int(result.id), 1)}


def test_the_backend_cancels_by_result_id_and_refuses_unknown_ids():
    backend = task_backends["default"]
    result = app.add.enqueue(4, b=4)
    assert backend.cancel(result.id) == CancelOutcome.CANCELLED
    for bad in ("999999999", "nope"):
        with pytest.raises(TaskResultDoesNotExist):
            backend.cancel(bad)
