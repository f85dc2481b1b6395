"""`@periodic`: a schedule declared next to its task, synced to the table by
`jobs.schedules.define.sync_periodic` (at migrate and when a runreaper starts).

    @periodic(cron="0 3 * * *", timezone="Europe/Berlin")
    @task("nightly-report")
    def nightly_report(payload, ctx): ...

The sync writes every field but `enabled`: staff may pause a declared schedule in
the admin and a deploy does not resume it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

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
    queue: str = "default",
    priority: int = 0,
    max_retries: int | None = None,
    timeout: float | None = None,
    catch_up: str = "skip",
    overlap: str = "allow",
    task: str | None = None,
    concurrency_key: str | None = None,
    interval: int | None = None,
) -> Callable:
    """Declare a schedule for the task registered on the decorated handler (put it
    above `@task`), or for `task` by name. Checked when synced. `interval_seconds` as
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
        DECLARED.append({
            "handler": fn,  # its registered task name is looked up at sync
            "name": name,
            "cron": cron,
            "interval_seconds": interval_seconds,
            "timezone": timezone,
            "task": task,
            "payload": {} if payload is None else payload,
            "queue": queue,
            "priority": priority,
            "max_retries": max_retries,
            "timeout": timeout,
            "catch_up": catch_up,
            "overlap": overlap,
            "concurrency_key": concurrency_key,
        })  # fmt: skip
        return fn

    return declare
