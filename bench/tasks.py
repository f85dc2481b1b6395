"""Tasks the bench needs besides the built-ins (listed in JOBS_TASK_MODULES by the bench)."""

from __future__ import annotations

from typing import Any

from jobs.tasks import JobContext, RetryableError, task


@task("bench.hold_first", example=True)
def hold_first(payload: Any, ctx: JobContext) -> dict:
    """Hold the first attempt for `seconds` (so a killed worker dies holding it);
    later attempts return at once, so recovery time is not hidden behind a rerun."""
    if ctx.attempt == 1 and not ctx.sleep(float(payload.get("seconds", 60))):
        raise RetryableError("interrupted")
    return {"attempt": ctx.attempt}


@task("bench.spin", example=True)
def spin(payload: Any, ctx: JobContext) -> int:
    """Pure-Python CPU work that holds the GIL: `n` loop turns."""
    total = 0
    for i in range(int(payload.get("n", 2_000_000))):
        total += i & 7
    return total
