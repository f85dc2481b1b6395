"""Handlers that misbehave towards their worker (issue 27), for the end-to-end tests and
the fault suite: JOBS_TASK_MODULES=tests.containment_tasks."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from jobs.tasks import JobContext, task

HANG_LIMIT = 120  # seconds a "hanging" handler really runs, so no test leaks it for ever


@task("contain.exit")
def exit_(payload: Any, ctx: JobContext) -> None:
    """sys.exit() from a handler thread."""
    sys.exit(3)


@task("contain.keyboard_interrupt")
def keyboard_interrupt(payload: Any, ctx: JobContext) -> None:
    raise KeyboardInterrupt


@task("contain.hang", timeout=2)
def hang(payload: Any, ctx: JobContext) -> str:
    """Loops ignoring ctx.stop: only the watchdog ends its attempt."""
    until = time.monotonic() + HANG_LIMIT
    while time.monotonic() < until:
        time.sleep(0.05)
    return "woke up"


@task("contain.cooperative", timeout=1)
def cooperative(payload: dict, ctx: JobContext) -> str:
    """Waits on ctx.stop and writes what it saw when told to stop."""
    stopped = ctx.stop.wait(HANG_LIMIT)
    Path(payload["report"]).write_text(f"stopped={stopped} timed_out={ctx.timed_out}")
    return "returned after the stop"
