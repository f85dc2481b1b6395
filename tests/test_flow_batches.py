"""Batches against the real database (jobs.flow.batches): the callbacks are made once,
by the end of the last job, with the counts and failed ids; the bookkeeping is linear
(row counts from pg_stat_xact_user_tables, as tests/test_workflow_linear.py does)."""

from __future__ import annotations

import pytest

from bench.flow_batch import measured
from jobs import services
from jobs.exceptions import BatchInvalid, InvalidSubmission, RequestInvalid
from jobs.flow import batches, triggers
from jobs.flow.triggers import T
from jobs.migrations import _triggers
from jobs.models import Batch, BatchFailure, Job

pytestmark = pytest.mark.django_db(transaction=True)


def _jobs(n: int, task: str = "echo") -> list[dict]:
    return [{"task": task, "payload": {"i": i}} for i in range(n)]


def _end(job_ids, *, failing=()) -> None:
    leases = services.claim_ids("w-batch", list(job_ids))
    assert len(leases) == len(job_ids)
    services.complete([(lease, None) for lease in leases if lease.job_id not in failing])
    services.fail([(lease, "boom", True) for lease in leases if lease.job_id in failing])


def _members(batch_id: int) -> list[int]:
    return list(Job.objects.filter(batch_id=batch_id).order_by("id").values_list("pk", flat=True))


def test_the_frozen_trigger_sql_is_what_the_module_generates():
    assert _triggers.FLOW_TRIGGERS_0027 == triggers.triggers_sql()
    assert _triggers.DROP_FLOW_TRIGGERS_0027 == triggers.drop_triggers_sql()
    assert T == "jobs_job"


def test_callbacks_are_made_once_by_the_last_end_with_counts_and_failed_ids():
    batch_id, created = batches.create(
        _jobs(5),
        {
            "on_complete": batches.task_callback("echo", {"to": "ops"}),
            "on_success": batches.task_callback("echo", {"never": True}),
            "on_failure": batches.task_callback("echo", {"alert": True}, queue="default"),
        },
        name="thumbs",
    )
    assert created
    ids = _members(batch_id)
    assert len(ids) == 5
    _end(ids[:2], failing={ids[1]})
    row = Batch.objects.get(pk=batch_id)
    assert (row.pending, row.succeeded, row.failed, row.finished_at) == (3, 1, 1, None)
    assert row.callback_job_ids is None
    _end(ids[2:], failing={ids[4]})
    row = Batch.objects.get(pk=batch_id)
    assert (row.pending, row.succeeded, row.failed) == (0, 3, 2)
    assert row.finished_at is not None
    made = list(Job.objects.filter(pk__in=row.callback_job_ids).order_by("id"))
    assert [m.payload.get("to") or m.payload.get("alert") for m in made] == ["ops", True]
    summary = made[0].payload["batch"]
    assert summary == {
        "id": batch_id, "name": "thumbs", "total": 5, "succeeded": 3, "failed": 2,
        "failed_ids": [ids[1], ids[4]],
    }  # fmt: skip
    assert all(m.status == "queued" and m.batch_id is None for m in made)

    # A staff retry after the end changes nothing made: the callbacks ran once.
    services.staff_retry([ids[1]], "staff:t")
    _end([ids[1]])
    assert Job.objects.filter(task="echo", payload__batch__id=batch_id).count() == 2
    progress = batches.progress(batch_id)
    assert (progress["fraction"], progress["callback_jobs"]) == (1.0, row.callback_job_ids)


def test_a_staff_retry_before_the_end_is_counted_again():
    batch_id, _ = batches.create(_jobs(2), {"on_success": batches.task_callback("echo")})
    a, b = _members(batch_id)
    _end([a], failing={a})
    services.staff_retry([a], "staff:t")
    row = Batch.objects.get(pk=batch_id)
    assert (row.pending, row.failed) == (2, 0)
    assert not BatchFailure.objects.filter(batch_id=batch_id).exists()
    _end([a, b])
    row = Batch.objects.get(pk=batch_id)
    assert (row.succeeded, row.failed, len(row.callback_job_ids)) == (2, 0, 1)


def test_cancelling_the_batch_jobs_counts_them_failed():
    batch_id, _ = batches.create(_jobs(3), {"on_complete": batches.task_callback("echo")})
    ids = _members(batch_id)
    services.cancel(ids, "staff:t")
    row = Batch.objects.get(pk=batch_id)
    assert (row.pending, row.failed, len(row.callback_job_ids)) == (0, 3, 1)


def test_refusals_write_nothing():
    before = (Job.objects.count(), Batch.objects.count())
    with pytest.raises(BatchInvalid) as refused:
        batches.create([*_jobs(2), {"task": "no-such-task", "payload": {}}], {})
    assert "jobs.2.task" in refused.value.errors
    with pytest.raises(BatchInvalid):
        batches.create([{"task": "echo", "payload": {}, "idempotency_key": "k"}], {})
    with pytest.raises(RequestInvalid) as bad:
        batches.submit_request({"jobs": _jobs(1), "on_complete": {"task": "echo", "payload": []}})
    assert "on_complete.payload" in bad.value.errors
    with pytest.raises(RequestInvalid):
        batches.submit_request({"jobs": [], "extra": 1})
    with pytest.raises(InvalidSubmission):
        batches.submit_request({"jobs": _jobs(1)}, idempotency_key="has space")
    assert (Job.objects.count(), Batch.objects.count()) == before


def test_an_idempotency_key_replays_the_batch():
    body = {"jobs": _jobs(2), "on_complete": {"task": "echo"}}
    first, created = batches.submit_request(body, idempotency_key="b-1")
    again, created_again = batches.submit_request(body, idempotency_key="b-1")
    assert (created, again, created_again) == (True, first, False)
    with pytest.raises(batches.BatchConflict):
        batches.submit_request({**body, "name": "other"}, idempotency_key="b-1")
    assert Job.objects.filter(batch_id=first).count() == 2


def test_bookkeeping_is_linear_in_the_batch(capsys):
    n = 3000
    (batch_id, _), created, create_s = measured(
        lambda: batches.create(_jobs(n), {"on_complete": batches.task_callback("echo")})
    )
    assert created[T][0] == n  # the jobs, nothing per job elsewhere
    assert created["jobs_batch"][0] == 1
    ids = _members(batch_id)
    half = n // 2
    _, ended, end_s = measured(lambda: _end(ids[:half], failing=set(ids[:10])))
    assert ended[T][1] <= 3 * half  # claimed, ended: nothing more per job
    # One batch row update per statement (complete, fail), one failure row per failed job.
    assert ended["jobs_batch"][1] <= 2
    assert ended["jobs_batchfailure"][0] == 10
    _, last, last_s = measured(lambda: _end(ids[half:]))
    assert last["jobs_batch"][1] <= 2
    assert last[T][0] == 1  # the on_complete job
    with capsys.disabled():
        print(f"\nbatch of {n}: create {create_s:.3f} s, end half {end_s:.3f} s, "
              f"end the rest {last_s:.3f} s (database time)")  # fmt: skip


def test_a_batch_of_django_tasks_with_a_django_task_callback():
    from tests.tasks_app import tasks as app

    batch = batches.Batch("sums", on_complete=batches.task_callback(app.echo))
    for n in range(3):
        batch.add(app.add, args=[n], kwargs={"b": 1})
    batch_id = batch.submit()
    ids = _members(batch_id)
    assert Job.objects.get(pk=ids[0]).task == "tests.tasks_app.tasks.add"
    assert Job.objects.get(pk=ids[2]).payload == {"args": [2], "kwargs": {"b": 1}}
    _end(ids)
    made = Job.objects.get(pk=Batch.objects.get(pk=batch_id).callback_job_ids[0])
    assert made.task == "tests.tasks_app.tasks.echo" and made.priority == 10
    assert made.payload["kwargs"]["batch"]["succeeded"] == 3  # the task gets batch=
    with pytest.raises(InvalidSubmission):
        batches.Batch("empty").submit()
