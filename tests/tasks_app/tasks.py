"""@task functions of the sample app, written against the Django Tasks API only
(plus jobservice's retry policy). The tests enqueue them and `runworker` runs them."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from jobs.backends import retries, timeout
from jobs.tasks import PermanentError
from jobs.tasks_compat import TaskContext, task
from tests.tasks_app import signals  # noqa: F401  (the receivers)


@task
def add(a: int, b: int) -> int:
    return a + b


@task(priority=10)
def echo(*args, **kwargs) -> dict:
    return {"args": list(args), "kwargs": kwargs}


@task
async def async_add(a: int, b: int) -> dict:
    await asyncio.sleep(0.01)
    loop = asyncio.get_running_loop()
    return {"sum": a + b, "ran_in_loop": loop.is_running()}


@task(takes_context=True)
def whoami(context: TaskContext, note: str) -> dict:
    r = context.task_result
    return {
        "id": r.id,
        "attempt": context.attempt,
        "worker_ids": r.worker_ids,
        "note": note,
        # What the task was enqueued with, not the decorator's defaults.
        "priority": r.task.priority,
        "queue": r.task.queue_name,
        "run_after": r.task.run_after.isoformat() if r.task.run_after else None,
    }


@task
@retries(1)
def flaky_once(marker: str) -> str:
    """Fails its first attempt (ValueError), succeeds on the retry."""
    path = Path(marker)
    if not path.exists():
        path.write_text("failed once")
        raise ValueError("first attempt fails")
    return "second attempt"


@task
@retries(2)
def always_fails(message: str) -> None:
    raise KeyError(message)


@task
def refuses(message: str) -> None:
    raise PermanentError(message)


@task
def record(log: str, label: str) -> str:
    """Appends `label` to the file `log`: the order tasks ran in."""
    with open(log, "a") as f:
        f.write(label + "\n")
    return label


@task(takes_context=True)
def slow_first_attempt(context: TaskContext, marker: str, seconds: float) -> dict:
    """The first attempt writes `marker` (its pid) and sleeps `seconds`; a later one
    returns at once. Killing the first worker leaves the rest to the reaper."""
    if context.attempt == 1:
        Path(marker).write_text(str(os.getpid()))
        time.sleep(seconds)
    return {"attempt": context.attempt, "pid": os.getpid()}


@task
def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@task(takes_context=True)
def halfway(context: TaskContext, hold: float) -> str:
    """Reports progress through the backend's context, then holds so that the worker's
    heartbeat writes it."""
    context.progress(1, 2, "half way")
    context.stop.wait(hold)
    return "done" if not context.cancelled else "cancelled"


@task
@retries(0)
def exit_task() -> None:
    """Ends like a script: SystemExit (django-tasks' test_system_exit_task)."""
    import sys

    sys.exit(1)


@task
@retries(0)
def keyboard_interrupt_task() -> None:
    """Raises what Ctrl-C raises (django-tasks' test_keyboard_interrupt_task)."""
    raise KeyboardInterrupt


@task(takes_context=True)
@retries(0)
@timeout(1)
def overruns(context: TaskContext) -> str:
    """Waits on the context's stop, which its 1 s timeout sets."""
    context.stop.wait(60)
    return "stopped"


@timeout(3)
@retries(4)
@task
def marked_above(n: int) -> int:
    """The markers above @task: the order does not matter."""
    return n


@task
def complex_return_value():
    """Returns what JSON cannot hold (django-tasks' test_complex_return_value)."""
    return lambda: True


@task(takes_context=True)
def sum_of_parents(context: TaskContext) -> int:
    """A workflow step: the sum of its parents' return values."""
    return sum(context.parent_results.values())
