"""Every attempt ends, whatever its handler does (issue 27), against real `runworker`
processes: SystemExit and KeyboardInterrupt fail their attempt and the worker goes on;
a handler that ignores ctx.stop is ended at its timeout plus the grace; a worker that
abandoned too many stuck threads starts again in a fresh process."""

from __future__ import annotations

import time

import pytest

from jobs import services
from jobs.models import JobEvent
from tests.conftest import job_row
from tests.harness import wait_until

pytestmark = pytest.mark.slow

MODULES = "demo.tasks,tests.containment_tasks"
GRACE = 1.0


def worker(stack, *args: str, **env: str):
    return stack.worker(
        "--concurrency",
        "1",
        *args,
        JOBS_TASK_MODULES=MODULES,
        JOBS_TIMEOUT_GRACE=str(GRACE),
        JOBS_RETRY_BACKOFF_BASE="0.1",
        **env,
    )


def submit(task: str, payload=None, max_retries: int = 0) -> int:
    return services.submit_many([services.NewJob(task, payload or {}, max_retries=max_retries)])[
        0
    ].job_id


def attempts(job_id: int) -> list[JobEvent]:
    """The events that ended an attempt of the job, oldest first."""
    return list(
        JobEvent.objects.filter(job_id=job_id, from_status="processing", kind="transition")
        .exclude(to_status="processing")
        .order_by("id")
    )


def claimed_at(job_id: int) -> list:
    return list(
        JobEvent.objects.filter(job_id=job_id, to_status="processing", kind="transition")
        .order_by("id")
        .values_list("at", flat=True)
    )


def test_system_exit_and_keyboard_interrupt_fail_their_attempt_and_burst_exits(stack):
    """A --concurrency 1 burst worker: both attempts end failed (budget 0) with the
    class in the error within seconds, the next job runs, and the worker exits."""
    exits = submit("contain.exit")
    interrupt = submit("contain.keyboard_interrupt")
    echo = submit("echo", {"after": "both"})
    started = time.monotonic()
    w = worker(stack, "--burst")
    assert w.wait(30) == 0
    assert time.monotonic() - started < 20
    for job_id, cls, message in (
        (exits, "builtins.SystemExit", "SystemExit: 3"),
        (interrupt, "builtins.KeyboardInterrupt", "KeyboardInterrupt: "),
    ):
        row = job_row(job_id)
        assert (row["status"], row["error_class"], row["error"]) == ("failed", cls, message)
        assert cls.split(".")[1] in row["error_traceback"]
        (end,) = attempts(job_id)
        assert (end.at - claimed_at(job_id)[0]).total_seconds() < 5
    assert job_row(echo)["status"] == "done"
    assert "Exception in thread" not in w.output()


def test_handler_ignoring_stop_ends_at_timeout_plus_grace_and_is_retried(stack):
    """contain.hang (timeout=2) never looks at ctx.stop: each attempt ends within
    timeout + grace + 2 s with a `timeout:` error, is retried per its budget, and the
    --concurrency 1 worker runs the next job in a new thread."""
    hang = submit("contain.hang", max_retries=1)
    echo = submit("echo", {"after": "hang"})
    worker(stack)
    wait_until(lambda: job_row(echo)["status"] == "done", 20, message="the next job ran")
    wait_until(lambda: job_row(hang)["status"] == "failed", 20, message="retried, failed")
    row = job_row(hang)
    assert (row["status"], row["retry_count"]) == ("failed", 2)  # budget 1: two attempts
    ends = attempts(hang)
    assert len(ends) == 2
    for end, start in zip(ends, claimed_at(hang), strict=True):
        assert end.error.startswith("timeout:") and "2s timeout" in end.error
        assert end.error_class == "jobs.watchdog.AttemptTimeout"
        assert (end.at - start).total_seconds() < 2 + GRACE + 2
    assert ends[0].to_status == "queued" and ends[1].to_status == "failed"
    # The lease was bumped by the retry: the first attempt can no longer write anything.
    assert row["lease_version"] >= 2


def test_cooperative_handler_sees_timed_out_and_still_fails_with_timeout(stack, tmp_path):
    report = tmp_path / "report.txt"
    job_id = submit("contain.cooperative", {"report": str(report)})
    worker(stack)
    wait_until(lambda: job_row(job_id)["status"] == "failed", 20, message="timed out")
    assert report.read_text() == "stopped=True timed_out=True"
    row = job_row(job_id)
    assert row["error"].startswith("timeout:") and "1s timeout" in row["error"]
    assert "stopped on request" in row["error"]
    (end,) = attempts(job_id)
    assert (end.at - claimed_at(job_id)[0]).total_seconds() < 1 + GRACE


def test_too_many_abandoned_threads_restart_the_worker_in_a_fresh_process(stack):
    w = worker(stack, JOBS_MAX_ABANDONED_THREADS="1")
    hang = submit("contain.hang")
    wait_until(lambda: job_row(hang)["status"] == "failed", 20, message="hang timed out")
    first = job_row(hang)["updated_by"]
    # The delivery worker (D90) logs its own start: count the default queue's worker only.
    started = "worker started worker_id="
    wait_until(
        lambda: (
            sum("queues=['default']" in line for line in w.output().splitlines() if started in line)
            == 2
        ),
        30,
        message="started again",
    )
    echo = submit("echo", {"after": "restart"})
    wait_until(lambda: job_row(echo)["status"] == "done", 30, message="echo ran after restart")
    second = job_row(echo)["updated_by"]
    assert "restarting the worker" in w.output()
    assert w.alive()  # the same process (pid) runs on: exec'd, not exited
    pid = str(w.pid)
    assert f":{pid}:" in first and f":{pid}:" in second
    assert first != second  # a new worker id: a fresh process image


def test_a_jobs_own_timeout_wins_over_its_tasks(stack):
    job_id = services.submit_many([services.NewJob("contain.hang", {}, max_retries=0, timeout=1)])[
        0
    ].job_id
    worker(stack)
    wait_until(lambda: job_row(job_id)["status"] == "failed", 15, message="timed out")
    (end,) = attempts(job_id)
    assert "1s timeout" in end.error
    assert (end.at - claimed_at(job_id)[0]).total_seconds() < 1 + GRACE + 2
