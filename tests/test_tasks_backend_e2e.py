"""Django Tasks on jobservice, run by real `runworker` (and `runreaper`) processes
against the real PostgreSQL and Redis: the sample app in tests/tasks_app."""

from __future__ import annotations

import json
import signal
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from jobs.backends import AttemptLost
from jobs.lifecycle import Status
from jobs.models import Job, JobEvent
from jobs.tasks_compat import TaskResultStatus
from tests.harness import free_port, wait_until
from tests.tasks_app import tasks as app

pytestmark = pytest.mark.slow

MODULES = "tests.tasks_app.tasks"


@pytest.fixture
def signal_log(tmp_path, monkeypatch) -> Path:
    """Where the sample app's receivers write, in this process and in the workers."""
    path = tmp_path / "signals.jsonl"
    monkeypatch.setenv("TASKS_APP_SIGNAL_LOG", str(path))
    return path


def heard(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def worker(stack, signal_log: Path, *args: str, **env: str):
    return stack.worker(
        "--concurrency",
        "2",
        *args,
        JOBS_TASK_MODULES=MODULES,
        TASKS_APP_SIGNAL_LOG=str(signal_log),
        JOBS_RETRY_BACKOFF_BASE="0.1",
        **env,
    )


def finished(*results) -> bool:
    for r in results:
        r.refresh()
    return all(r.is_finished for r in results)


def test_sync_async_and_context_tasks_run_in_the_worker_and_signal(stack, signal_log):
    w = worker(stack, signal_log)
    add = app.add.enqueue(2, b=3)
    echo = app.echo.enqueue("a", [1, 2], key={"nested": True})
    aio = app.async_add.enqueue(20, 22)
    ctx = app.whoami.enqueue(note="hi")
    wait_until(lambda: finished(add, echo, aio, ctx), 30, message="all four finished")

    assert [r.status for r in (add, echo, aio, ctx)] == [TaskResultStatus.SUCCESSFUL] * 4
    assert add.return_value == 5
    assert echo.return_value == {"args": ["a", [1, 2]], "kwargs": {"key": {"nested": True}}}
    assert aio.return_value == {"sum": 42, "ran_in_loop": True}
    assert ctx.return_value == {
        "id": ctx.id,
        "attempt": 1,
        "worker_ids": ctx.worker_ids,
        "note": "hi",
        "priority": 0,
        "queue": "default",
        "run_after": None,
    }
    for r in (add, echo, aio, ctx):
        assert r.attempts == 1 and r.errors == []
        assert r.enqueued_at <= r.started_at == r.last_attempted_at <= r.finished_at
    assert {w_id for r in (add, echo, aio, ctx) for w_id in r.worker_ids} == {
        Job.objects.get(pk=int(add.id)).updated_by.removeprefix("worker:")
    }

    events = heard(signal_log)
    for r in (add, echo, aio, ctx):
        mine = [(e["signal"], e["status"]) for e in events if e["id"] == r.id]
        assert mine == [("enqueued", "READY"), ("started", "RUNNING"), ("finished", "SUCCESSFUL")]
    w.signal(signal.SIGTERM)
    assert w.wait(15) == 0


def test_context_reports_progress_through_the_heartbeat(stack, signal_log):
    """A takes_context task reports progress like any handler (ctx.progress): the job's
    `progress` holds it, written by the worker's fenced heartbeat and kept when done."""
    worker(stack, signal_log)
    r = app.halfway.enqueue(hold=2.5)
    job_id = int(r.id)
    wait_until(
        lambda: (Job.objects.get(pk=job_id).progress or {}).get("done") == 1,
        20,
        message="progress written while running",
    )
    assert Job.objects.get(pk=job_id).status == Status.PROCESSING
    wait_until(lambda: finished(r), 20, message="the task finished")
    assert r.status == TaskResultStatus.SUCCESSFUL and r.return_value == "done"
    progress = Job.objects.get(pk=job_id).progress
    assert (progress["done"], progress["total"], progress["message"]) == (1, 2, "half way")


def test_errors_retries_and_permanent_errors(stack, signal_log, tmp_path):
    worker(stack, signal_log)
    flaky = app.flaky_once.enqueue(str(tmp_path / "flaky-marker"))
    spent = app.always_fails.enqueue("gone")
    refused = app.refuses.enqueue("no")
    wait_until(lambda: finished(flaky, spent, refused), 30, message="all three finished")

    assert flaky.status == TaskResultStatus.SUCCESSFUL and flaky.return_value == "second attempt"
    assert flaky.attempts == 2
    assert [e.exception_class for e in flaky.errors] == [ValueError]
    assert "first attempt fails" in flaky.errors[0].traceback

    assert spent.status == TaskResultStatus.FAILED
    assert spent.attempts == 3  # @retries(2): the first attempt and two retries
    assert [e.exception_class_path for e in spent.errors] == ["builtins.KeyError"] * 3

    assert refused.status == TaskResultStatus.FAILED and refused.attempts == 1
    assert [e.exception_class_path for e in refused.errors] == ["jobs.tasks.PermanentError"]

    events = heard(signal_log)

    def seen(r):
        return [(e["signal"], e["status"], e["errors"]) for e in events if e["id"] == r.id]

    earlier = ["builtins.ValueError"]  # the second attempt starts knowing the first's error
    assert seen(flaky) == [
        ("enqueued", "READY", []),
        ("started", "RUNNING", []),
        ("started", "RUNNING", earlier),
        ("finished", "SUCCESSFUL", earlier),
    ]
    assert seen(spent)[-1] == ("finished", "FAILED", ["builtins.KeyError"] * 3)
    assert [s[0] for s in seen(spent)].count("finished") == 1
    assert seen(refused)[-1] == ("finished", "FAILED", ["jobs.tasks.PermanentError"])


@pytest.mark.parametrize("wake", ["postgres", "redis"])
def test_higher_priority_runs_first(stack, signal_log, tmp_path, wake):
    if wake == "postgres":  # no Redis: the worker claims in PostgreSQL's order
        stack.env["REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    log = str(tmp_path / "order.log")
    low = app.record.using(priority=-5).enqueue(log, "low")
    mid = app.record.enqueue(log, "mid")
    high = app.record.using(priority=50).enqueue(log, "high")
    worker(stack, signal_log, "--concurrency", "1")
    wait_until(lambda: finished(low, mid, high), 30, message="all ran")
    assert Path(log).read_text().split() == ["high", "mid", "low"]


def test_run_after_and_queue_names(stack, signal_log, tmp_path):
    log = str(tmp_path / "order.log")
    two_queues = {
        "default": {"BACKEND": "jobs.backends.JobServiceBackend", "QUEUES": ["default", "emails"]}
    }
    declared = {"default": {}, "emails": {}}  # the deployment's allowlist (JOBS_QUEUES)
    with override_settings(TASKS=two_queues, JOBS_QUEUES=declared):
        later = timezone.now() + timedelta(seconds=2)
        deferred = app.record.using(priority=100, run_after=later).enqueue(log, "deferred")
        now = app.record.enqueue(log, "now")
        email = app.record.using(queue_name="emails").enqueue(log, "email")
    worker(stack, signal_log, "--queues", "default", JOBS_QUEUES=json.dumps(declared))
    wait_until(lambda: finished(deferred, now), 30, message="default queue drained")

    # The deferred task (priority 100) never starts before its run_after. (Which of the
    # two starts first depends on how long the worker took to start on a busy machine:
    # once both are due, priority decides.)
    assert sorted(Path(log).read_text().split()) == ["deferred", "now"]
    assert deferred.started_at >= later
    email.refresh()
    assert email.status == TaskResultStatus.READY and email.worker_ids == []
    worker(stack, signal_log, "--queues", "emails", JOBS_QUEUES=json.dumps(declared))
    wait_until(lambda: finished(email), 20, message="emails queue drained")
    assert email.return_value == "email"


def test_worker_killed_mid_task_completes_once_via_the_reaper(stack, signal_log, tmp_path):
    marker = tmp_path / "first-attempt.pid"
    lease = {"JOBS_LEASE_SECONDS": "2"}
    first = worker(stack, signal_log, **lease)
    result = app.slow_first_attempt.enqueue(str(marker), 60)
    wait_until(marker.exists, 30, message="first attempt running")
    killed_pid = int(marker.read_text())
    first.kill()  # SIGKILL: no goodbye, the lease just stops being renewed
    stack.reaper("--interval", "0.5", **lease)
    worker(stack, signal_log, **lease)
    wait_until(lambda: finished(result), 30, message="completed after the reap")

    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value["attempt"] == 2 and result.return_value["pid"] != killed_pid
    assert result.attempts == 2 and len(set(result.worker_ids)) == 2
    assert [e.exception_class for e in result.errors] == [AttemptLost]
    # Recovered by crash detection (the session is gone) or, if the reaper's first
    # look came later than the 2 s lease, by the lease's expiry.
    assert "worker gone" in result.errors[0].traceback or (
        "lease expired" in result.errors[0].traceback
    )
    job_id = int(result.id)
    assert JobEvent.objects.filter(job_id=job_id, to_status="done").count() == 1
    assert Job.objects.get(pk=job_id).lease_version == 3  # claim, reap, claim


def test_task_longer_than_its_lease_keeps_it_by_heartbeats(stack, signal_log):
    lease = {"JOBS_LEASE_SECONDS": "1"}
    worker(stack, signal_log, **lease)
    stack.reaper("--interval", "0.5", **lease)
    result = app.nap.enqueue(3.0)
    wait_until(lambda: finished(result), 30, message="nap finished")
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 3.0
    assert result.attempts == 1 and result.errors == []
    assert Job.objects.get(pk=int(result.id)).lease_version == 1  # never reaped


def test_task_after_its_database_session_was_terminated_runs_first_time(stack, signal_log):
    """A handler thread whose session PostgreSQL ended gets a new one for the next task."""
    worker(stack, signal_log, "--concurrency", "1")
    before = app.add.enqueue(1, 1)
    wait_until(lambda: finished(before), 20, message="first task ran")
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        assert cur.fetchone()[0] >= 1
    after = app.add.enqueue(2, 2)
    wait_until(lambda: finished(after), 20, message="second task ran")
    assert after.status == TaskResultStatus.SUCCESSFUL and after.return_value == 4
    assert after.attempts == 1 and after.errors == []


def test_rolled_back_enqueue_never_runs(stack, signal_log, tmp_path):
    log = tmp_path / "ran.log"
    worker(stack, signal_log)
    with pytest.raises(RuntimeError), transaction.atomic():
        ghost = app.record.enqueue(str(log), "rolled back")
        raise RuntimeError("the caller's change fails")
    kept = app.record.enqueue(str(log), "committed")
    wait_until(lambda: finished(kept), 20, message="committed task ran")
    assert log.read_text().split("\n") == ["committed", ""]
    assert not Job.objects.filter(pk=int(ghost.id)).exists()
    assert [e["id"] for e in heard(signal_log)].count(ghost.id) == 0


# django-tasks' own backend tests for handlers that end the way scripts do
# (test_system_exit_task, test_keyboard_interrupt_task, test_worker_doesnt_exit), on ours.


@pytest.mark.parametrize(
    ("task", "exception"),
    [(app.exit_task, SystemExit), (app.keyboard_interrupt_task, KeyboardInterrupt)],
    ids=["test_system_exit_task", "test_keyboard_interrupt_task"],
)
def test_base_exceptions_fail_the_task_and_the_worker_doesnt_exit(
    stack, signal_log, task, exception
):
    w = worker(stack, signal_log, "--concurrency", "1")
    result = task.enqueue()
    wait_until(lambda: finished(result), 30, message="the task failed")  # with start-up
    assert result.status == TaskResultStatus.FAILED
    assert [e.exception_class for e in result.errors] == [exception]
    assert exception.__name__ in result.errors[0].traceback
    finished_signals = [e for e in heard(signal_log) if e["id"] == result.id]
    assert finished_signals[-1]["signal"] == "finished"
    assert finished_signals[-1]["status"] == "FAILED"
    # test_worker_doesnt_exit: the same one-thread worker runs the next task.
    after = app.add.enqueue(1, 2)
    wait_until(lambda: finished(after), 10, message="the next task ran")
    assert after.return_value == 3 and w.alive()


def test_timeout_marker_bounds_the_task_and_sets_its_stop(stack, signal_log):
    worker(stack, signal_log, JOBS_TIMEOUT_GRACE="1")
    result = app.overruns.enqueue()
    assert Job.objects.get(pk=int(result.id)).timeout == 1.0
    wait_until(lambda: finished(result), 15, message="the task timed out")
    assert result.status == TaskResultStatus.FAILED
    assert Job.objects.get(pk=int(result.id)).error.startswith("timeout:")


def test_a_cancelled_task_reads_as_cancelled_and_an_unstorable_value_as_a_type_error(
    stack, signal_log
):
    """A running cancel was AttemptLost (a lease expiry); django-tasks'
    test_complex_return_value expects TypeError, as Django's own backends record it."""
    from jobs import services
    from jobs.backends import JobCancelled

    worker(stack, signal_log)
    held = app.halfway.enqueue(60)
    bad = app.complex_return_value.enqueue()
    wait_until(lambda: held.refresh() or held.status == TaskResultStatus.RUNNING, 20)
    assert services.request_cancel([int(held.id)], "staff:ann") == {int(held.id): "requested"}
    wait_until(lambda: finished(held, bad), 30, message="the cancel and the bad value")
    assert held.status == TaskResultStatus.FAILED
    assert [e.exception_class for e in held.errors] == [JobCancelled]
    assert bad.status == TaskResultStatus.FAILED
    assert issubclass(bad.errors[0].exception_class, TypeError), bad.errors
    assert "not JSON-serializable" in bad.errors[0].traceback


def test_a_workflow_of_django_tasks_hands_each_step_its_parents_results(stack, signal_log):
    from jobs.workflows import Workflow, detail

    wf = Workflow("sums").step("a", app.add, args=[1, 2]).step("b", app.add, args=[3, 4])
    workflow_id = wf.step("c", app.sum_of_parents, after=["a", "b"]).submit()
    jobs = {s["id"]: s["job_id"] for s in detail(workflow_id)["steps"]}
    worker(stack, signal_log)
    last = app.sum_of_parents.get_result(str(jobs["c"]))
    wait_until(lambda: finished(last), 30, message="the last step")
    assert (last.status, last.return_value) == (TaskResultStatus.SUCCESSFUL, 10)
