"""Tasks only the fault suite submits (JOBS_TASK_MODULES=demo.tasks,chaos.tasks)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from jobs.tasks import JobContext, task

BAD_RESULTS = {
    "set": lambda: {"ids": {1, 2}},  # not JSON
    "nan": lambda: {"ratio": float("nan")},  # JSON to Python, not to jsonb
    "nul": lambda: {"text": "a\x00b"},  # jsonb cannot hold NUL
}


@task("chaos.bad_result", example=True)
def bad_result(payload: Any, ctx: JobContext) -> Any:
    """Return a result PostgreSQL cannot store: the job must fail, not the worker (D20)."""
    kind = payload.get("kind") if isinstance(payload, dict) else None
    return BAD_RESULTS.get(kind, BAD_RESULTS["set"])()


HANG_TIMEOUT = 1  # seconds: chaos.hang's own timeout
HANG_SECONDS = 6  # how long it really runs, ignoring ctx.stop (then its thread is free)


@task("chaos.hang", timeout=HANG_TIMEOUT, example=True)
def hang(payload: Any, ctx: JobContext) -> Any:
    """Ignores ctx.stop past its timeout: the watchdog must end the attempt (issue 27),
    and whatever it returns afterwards must not land."""
    until = time.monotonic() + HANG_SECONDS
    while time.monotonic() < until:
        time.sleep(0.05)
    return {"woke": True}


@task("chaos.exit", example=True)
def exit_(payload: Any, ctx: JobContext) -> Any:
    """sys.exit() in a handler: a failed attempt, never a dead handler thread (issue 27)."""
    sys.exit(2)


@task("chaos.die", example=True)
def die(payload: Any, ctx: JobContext) -> Any:
    """os._exit() mid-job, served only by process-pool workers (queue "children"): the
    child dies, its attempt fails at once, and the worker goes on with a new child."""
    os._exit(9)


def _work(seconds: float, n: int) -> dict:
    time.sleep(seconds)  # long enough for a kill to land inside a step
    return {"step": n}


@task("chaos.steps", example=True)
def steps(payload: Any, ctx: JobContext) -> Any:
    """A few checkpointed steps (jobs.durable): a killed attempt resumes after the last
    committed one; a stale attempt's checkpoint must be refused."""
    count = int(payload.get("steps", 4)) if isinstance(payload, dict) else 4
    seconds = float(payload.get("seconds", 0.2)) if isinstance(payload, dict) else 0.2
    return [ctx.step(f"s{n}", _work, seconds, n) for n in range(count)]  # type: ignore[attr-defined]


@task("chaos.nap", durable=True, example=True)
def nap(payload: Any, ctx: JobContext) -> Any:
    """A step, a durable sleep (the job parks: processing → queued, no retry), a step."""
    seconds = float(payload.get("seconds", 1.0)) if isinstance(payload, dict) else 1.0
    before = ctx.step("before", _work, 0.05, 0)  # type: ignore[attr-defined]
    ctx.sleep(seconds)
    return [before, ctx.step("after", _work, 0.05, 1)]  # type: ignore[attr-defined]


@task("chaos.chain", durable=True, example=True)
def chain(payload: Any, ctx: JobContext) -> Any:
    """A durable loop that continues as new (issue 45): `per_run` iterations of a step
    and a 0-second durable sleep per run, `runs` runs, the count carried in the payload."""
    p = payload if isinstance(payload, dict) else {}
    run, per_run, runs = int(p.get("run", 1)), int(p.get("per_run", 3)), int(p.get("runs", 3))
    for i in range(per_run):
        ctx.step(f"it-{i}", _work, 0.02, i)  # type: ignore[attr-defined]
        ctx.sleep(0)
    if run < runs:
        ctx.continue_as_new({**p, "run": run + 1})  # type: ignore[attr-defined]
    return {"runs": run}
