"""`runworker --pool processes` against real worker processes (issue 27): each job runs
in a pre-forked child; a child that dies mid-job fails that attempt at once and is
replaced; at timeout + grace the child is killed; children are recycled by count and
memory; results, progress, steps, signals and cancellation work as in the thread pool,
every job-state write going through the parent."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from django.core.management import CommandError, call_command

from jobs import services
from jobs.signals import signal_job
from tests.conftest import job_row
from tests.harness import wait_until
from tests.test_containment_e2e import GRACE, attempts, claimed_at, submit, worker

pytestmark = pytest.mark.slow


def pool(stack, *args: str, **env: str):
    return worker(stack, "--pool", "processes", *args, **env)


def test_handler_ignoring_stop_is_killed_at_timeout_plus_grace_and_the_next_job_runs(stack):
    hang = submit("contain.hang")
    first = submit("contain.pid")
    w = pool(stack)
    wait_until(lambda: job_row(hang)["status"] == "failed", 20, message="hang timed out")
    (end,) = attempts(hang)
    assert end.error.startswith("timeout:") and "2s timeout" in end.error
    assert end.error_class == "jobs.watchdog.AttemptTimeout"
    assert (end.at - claimed_at(hang)[0]).total_seconds() < 2 + GRACE + 2
    wait_until(lambda: job_row(first)["status"] == "done", 20, message="the next job ran")
    # The stuck child was killed, not abandoned: the next job ran in a new child.
    assert job_row(first)["result"] != w.pid
    assert "abandoned" not in w.output()


@pytest.mark.parametrize("task", ["contain.os_exit", "contain.kill9"])
def test_a_child_that_dies_fails_its_attempt_at_once_and_is_replaced(stack, task):
    dies = submit(task)
    after = submit("contain.pid")
    w = pool(stack)
    wait_until(lambda: job_row(dies)["status"] == "failed", 10, message="the attempt ended")
    (end,) = attempts(dies)
    assert (end.at - claimed_at(dies)[0]).total_seconds() < 5
    expected = "exit code 1" if task == "contain.os_exit" else "signal 9 (SIGKILL)"
    assert end.error == f"worker child exited: {expected}"
    assert end.error_class == "jobs.worker.pools.processes.ChildExited"
    wait_until(lambda: job_row(after)["status"] == "done", 10, message="the next job ran")
    assert job_row(after)["result"] not in (w.pid, None)


def test_a_killed_child_is_retried_per_budget(stack):
    dies = submit("contain.kill9", max_retries=1)
    pool(stack)
    wait_until(lambda: job_row(dies)["status"] == "failed", 15, message="two attempts")
    assert [e.to_status for e in attempts(dies)] == ["queued", "failed"]


def test_max_tasks_per_child_changes_the_pid_every_n_jobs(stack):
    ids = [submit("contain.pid") for _ in range(12)]
    w = pool(stack, "--max-tasks-per-child", "5", "--burst")
    assert w.wait(60) == 0
    pids = [job_row(i)["result"] for i in ids]  # run in id order (--concurrency 1)
    assert pids[:5] == [pids[0]] * 5
    assert pids[5:10] == [pids[5]] * 5
    assert pids[10:] == [pids[10]] * 2
    assert len({pids[0], pids[5], pids[10]}) == 3
    assert w.pid not in pids


def test_max_memory_per_child_recycles_a_growing_child(stack):
    ids = [submit("contain.grow", {"mb": 60}) for _ in range(4)]
    w = pool(stack, "--max-memory-per-child", "100", "--burst")
    assert w.wait(60) == 0
    pids = [job_row(i)["result"] for i in ids]
    # Each job keeps 60 MB: the child passes 100 MB after one or two jobs and is replaced.
    assert len(set(pids)) >= 2
    assert "limit 100 MB): replacing it" in w.output()


def test_system_exit_and_keyboard_interrupt_in_a_child_fail_their_attempt(stack):
    exits = submit("contain.exit")
    interrupt = submit("contain.keyboard_interrupt")
    echo = submit("echo", {"after": "both"})
    w = pool(stack, "--burst")
    assert w.wait(30) == 0
    for job_id, cls in ((exits, "builtins.SystemExit"), (interrupt, "builtins.KeyboardInterrupt")):
        row = job_row(job_id)
        assert (row["status"], row["error_class"]) == ("failed", cls)
        assert cls.split(".")[1] in row["error_traceback"]
    assert job_row(echo)["status"] == "done"


def test_results_progress_steps_and_signals_go_through_the_parent(stack):
    held = submit("contain.report", {"value": 7, "hold": 2})
    waits = submit("contain.report", {"signal": "go"})
    w = pool(stack, "--concurrency", "2", JOBS_PROGRESS_INTERVAL="0.2")
    wait_until(lambda: job_row(held)["progress"] is not None, 10, message="progress written")
    assert json.loads(job_row(held)["progress"])["message"] == "half"
    wait_until(lambda: job_row(held)["status"] == "done", 10, message="done")
    result = job_row(held)["result"]
    assert result["step"] == 7 and result["pid"] != w.pid
    wait_until(lambda: job_row(waits)["status"] == "queued", 10, message="parked for its signal")
    signal_job(waits, "go", {"n": 1})
    wait_until(lambda: job_row(waits)["status"] == "done", 15, message="woken and done")
    assert job_row(waits)["result"]["signal"] == {"n": 1}
    # Every write is the parent's: the history names the parent's worker id only.
    owners = {row["updated_by"] for row in (job_row(held), job_row(waits))}
    assert all(f":{w.pid}:" in owner for owner in owners)


def test_cancel_reaches_the_handler_in_its_child(stack, tmp_path):
    flag = tmp_path / "running"
    job_id = submit("contain.report", {"wait_cancel": str(flag)})
    pool(stack, JOBS_LEASE_SECONDS="3")
    wait_until(flag.exists, 10, message="the handler runs")
    services.request_cancel([job_id], actor="test")
    wait_until(lambda: job_row(job_id)["status"] == "failed", 10, message="cancelled")
    assert job_row(job_id)["error"] == "cancelled"


def test_transactional_tasks_run_in_the_parent_and_keep_their_contract(stack):
    """D129: a transactional handler shares its transaction with the fenced completion,
    on the parent's connection, so it runs in the parent; the others in children."""
    tx = submit("contain.tx_pid")
    other = submit("contain.pid")
    w = pool(stack, "--burst")
    assert w.wait(30) == 0
    assert job_row(tx)["result"] == w.pid
    assert job_row(other)["result"] != w.pid


def test_bad_pool_options_are_refused():
    with pytest.raises(CommandError, match="invalid choice"):
        call_command("runworker", "--pool", "greenlets")
    with pytest.raises(CommandError, match="at least 0"):
        call_command("runworker", "--pool", "processes", "--max-tasks-per-child", "-1")
    with pytest.raises(CommandError, match="processes only"):
        call_command("runworker", "--max-memory-per-child", "100")


def test_stopping_a_process_pool_worker_leaves_no_child(stack):
    w = pool(stack, "--concurrency", "2")
    job_id = submit("contain.pid")
    wait_until(lambda: job_row(job_id)["status"] == "done", 15, message="ran")
    child = job_row(job_id)["result"]
    w.signal(signal.SIGTERM)
    assert w.wait(20) == 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_kill_9_of_a_child_from_outside_fails_its_attempt_at_once(stack):
    """An OOM kill or an operator's kill -9 of the child running a job."""
    job_id = submit("contain.report", {"hold": 60})
    w = pool(stack)
    wait_until(lambda: job_row(job_id)["status"] == "processing", 10, message="running")
    wait_until(lambda: job_row(job_id)["progress"] is not None, 10, message="in its handler")
    killed_at = time.monotonic()
    children = _children(w.pid)
    assert children
    for child in children:
        os.kill(child, signal.SIGKILL)
    wait_until(lambda: job_row(job_id)["status"] == "failed", 10, message="the attempt ended")
    assert time.monotonic() - killed_at < 5
    assert job_row(job_id)["error"] == "worker child exited: signal 9 (SIGKILL)"
    after = submit("contain.pid")
    wait_until(lambda: job_row(after)["status"] == "done", 10, message="a new child ran it")


def _children(pid: int) -> list[int]:
    """Every process whose parent is `pid` (forked from any of its threads)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def test_a_stuck_transactional_handler_is_abandoned_and_its_slot_served_again(stack):
    """D129: it runs in the parent's dispatcher thread, which cannot be killed: the
    attempt ends at timeout + grace and a new slot (with its own child) serves on."""
    stuck = submit("contain.tx_hang", {"seconds": 30})
    after = submit("contain.pid")
    w = pool(stack)
    wait_until(lambda: job_row(stuck)["status"] == "failed", 15, message="timed out")
    assert job_row(stuck)["error"].startswith("timeout:")
    wait_until(lambda: job_row(after)["status"] == "done", 15, message="the next job ran")
    assert job_row(after)["result"] != w.pid


def test_children_dying_together_each_fail_their_attempt_at_once(stack):
    """Four children die over and over and are forked again from four dispatcher threads
    at once (one fork at a time in the pool: a sibling forked while a child's pipe end was
    still open in the parent would hold a copy and hide that child's death until the
    sibling died too). Every attempt ends within seconds of its claim."""
    ids = [submit("contain.os_exit") for _ in range(40)]
    w = pool(stack, "--concurrency", "4")
    wait_until(lambda: all(job_row(i)["status"] == "failed" for i in ids), 60, message="all ended")
    for job_id in ids:
        (end,) = attempts(job_id)
        assert (end.at - claimed_at(job_id)[0]).total_seconds() < 5
        assert end.error == "worker child exited: exit code 1"
    wait_until(lambda: len(_children(w.pid)) == 4, 10, message="four children again")


def _paused_after_end(tmp_path, seconds: float = 0.3) -> dict[str, str]:
    """Each child sleeps `seconds` right after sending `end` (its reader thread reads the
    parent's next `run` meanwhile): the interleaving that lost the next job's flags."""
    hook = tmp_path / "pause-after-end"
    hook.write_text(str(seconds))
    return {"JOBS_TEST_PAUSE_AFTER_END": str(hook)}


def test_the_next_jobs_timeout_reaches_its_handler_while_the_child_pauses_after_end(
    stack, tmp_path
):
    """D210: the job a child runs right after another is told its time is up (the soft
    stop) and returns; lost, its child ran on until killed at timeout + grace."""
    report = tmp_path / "report"
    first = submit("contain.pid")
    after = submit("contain.cooperative", {"report": str(report)})
    pool(stack, **_paused_after_end(tmp_path))
    wait_until(lambda: job_row(after)["status"] == "failed", 20, message="timed out")
    assert job_row(first)["status"] == "done"
    (end,) = attempts(after)
    assert end.error.startswith("timeout:"), end.error
    assert report.exists(), "the handler was never told to stop: its child was killed"
    assert report.read_text() == "stopped=True timed_out=True"


def test_a_cancel_reaches_the_next_jobs_handler_while_the_child_pauses_after_end(stack, tmp_path):
    """D210: a cancel of the job a child runs right after another reaches its handler."""
    flag = tmp_path / "running"
    first = submit("contain.pid")
    after = submit("contain.report", {"wait_cancel": str(flag)})
    pool(stack, **_paused_after_end(tmp_path))
    wait_until(flag.exists, 15, message="the second handler runs")
    # The handler runs once the child's pause is over: the cancel comes after it.
    assert job_row(first)["status"] == "done"
    services.request_cancel([after], actor="test")
    wait_until(lambda: job_row(after)["status"] == "failed", 10, message="cancelled")
    assert job_row(after)["error"] == "cancelled"


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_a_result_pickle_cannot_carry_is_stored_as_in_the_thread_pool(stack, tmp_path, kind):
    """D212: a str subclass defined in the handler: JSON stores it, pickle cannot carry it
    from a child. Both pools store it `done`, the handler called once (it killed the
    child: `worker child exited: exit code 1`, retried with its side effects)."""
    calls = tmp_path / "calls"
    job_id = submit("contain.local_str", {"calls": str(calls)}, max_retries=2)
    after = submit("contain.pid")
    w = worker(stack, "--pool", kind, "--burst")
    assert w.wait(30) == 0
    row = job_row(job_id)
    assert (row["status"], row["result"], row["retry_count"]) == ("done", "labelled", 0), row
    assert len(calls.read_text().splitlines()) == 1
    assert job_row(after)["status"] == "done"
    assert "exited" not in w.output()
