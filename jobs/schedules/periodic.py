"""`@periodic`: a schedule declared next to its task, synced to the table by
`jobs.schedules.define.sync_periodic` (at migrate and when a runreaper starts).

    @periodic(cron="0 3 * * *", timezone="Europe/Berlin")
    @task("nightly-report")
    def nightly_report(payload, ctx): ...

    @periodic(interval_seconds=60, args=[10])  # above a Django @task: its arguments
    @django_task
    def tick(limit): ...

The sync writes every field but `enabled`: staff may pause a declared schedule in
the admin and a deploy does not resume it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from jobs import tasks

# The declarations, in order: a schedule's fields as jobs.schedules.define.FIELDS names
# them; `name` and `task` None until the sync reads the task registry.
DECLARED: list[dict[str, Any]] = []


def periodic(
    *,
    cron: str | None = None,
    interval_seconds: int | None = None,
    name: str | None = None,
    timezone: str = "UTC",
    payload: Any = None,
    queue: str | None = None,
    priority: int | None = None,
    max_retries: int | None = None,
    timeout: float | None = None,
    catch_up: str = "skip",
    overlap: str = "allow",
    task: Any = None,
    concurrency_key: str | None = None,
    interval: int | None = None,
    args: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> Callable:
    """Declare a schedule for the task registered on the decorated handler (put it
    above `@task`, jobservice's or Django's), or for `task`: a Django task object or
    a registered name. A Django task's job is what `enqueue(*args, **kwargs)` would
    submit (its queue, priority, retries and timeout unless given here); arguments JSON
    would change are refused here, the rest when synced (D223). `interval_seconds` as
    in the API; `interval` is its former name (D114)."""
    if interval is not None:
        warnings.warn(
            "@periodic(interval=...) is now interval_seconds=..., as in the API",
            DeprecationWarning,
            stacklevel=2,
        )
        if interval_seconds is None:
            interval_seconds = interval

    def declare(fn: Callable) -> Callable:
        job = tasks.job_of(task if task is not None else fn, payload, args, kwargs)
        DECLARED.append({
            "handler": fn,  # its registered task name is looked up at sync
            "name": name,
            "cron": cron,
            "interval_seconds": interval_seconds,
            "timezone": timezone,
            "task": job.get("task"),
            "payload": job.get("payload", {}),
            "queue": queue if queue is not None else job.get("queue", "default"),
            "priority": priority if priority is not None else job.get("priority", 0),
            "max_retries": max_retries if max_retries is not None else job.get("max_retries"),
            "timeout": timeout if timeout is not None else job.get("timeout"),
            "catch_up": catch_up,
            "overlap": overlap,
            "concurrency_key": concurrency_key,
        })  # fmt: skip
        return fn

    return declare
