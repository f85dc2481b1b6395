"""Tasks the bench needs besides the built-ins (listed in JOBS_TASK_MODULES by the bench)."""

from __future__ import annotations

from typing import Any

from jobs.tasks import JobContext, RetryableError, task


def _bench_task(name: str):
    """Registered as an example task, never public unless named (D196); a baseline tree
    from before D196 has no `example` and takes it as it took every task then."""
    try:
        return task(name, example=True)
    except TypeError:
        return task(name)


@_bench_task("bench.hold_first")
def hold_first(payload: Any, ctx: JobContext) -> dict:
    """Hold the first attempt for `seconds` (so a killed worker dies holding it);
    later attempts return at once, so recovery time is not hidden behind a rerun."""
    if ctx.attempt == 1 and not ctx.sleep(float(payload.get("seconds", 60))):
        raise RetryableError("interrupted")
    return {"attempt": ctx.attempt}


@_bench_task("bench.spin")
def spin(payload: Any, ctx: JobContext) -> int:
    """Pure-Python CPU work that holds the GIL: `n` loop turns."""
    total = 0
    for i in range(int(payload.get("n", 2_000_000))):
        total += i & 7
    return total


def _durable_bench_task(name: str):
    try:
        return task(name, example=True, durable=True)
    except TypeError:
        return task(name, durable=True)


@_durable_bench_task("bench.durable_steps")
def durable_steps(payload: Any, ctx: Any) -> int:
    """`steps` no-op checkpointed steps (the durable-steps bench, issue 45)."""
    n = int(payload.get("steps", 5))
    for i in range(n):
        ctx.step(f"s{i}", int, i)
    return n
