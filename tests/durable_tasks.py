"""Durable tasks for end-to-end tests (JOBS_TASK_MODULES=demo.tasks,tests.durable_tasks).

Each step counts its runs in a file of its own under payload["dir"]: an external
counter that survives kill -9 and tells how many times a step's function ran.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from jobs.tasks import task


def count_run(directory: str, name: str) -> int:
    """Append one line to dir/name and return how many runs that makes."""
    path = Path(directory) / name
    with path.open("a") as f:
        f.write("run\n")
    return len(path.read_text().splitlines())


def runs(directory: str, name: str) -> int:
    path = Path(directory) / name
    return len(path.read_text().splitlines()) if path.exists() else 0


def _counted_step(directory: str, n: int, hang: float) -> dict:
    run = count_run(directory, f"step{n}")
    if run == 1 and hang:
        time.sleep(hang)  # only the first run of this step hangs: kill -9 or SIGSTOP here
    return {"step": n, "run": run}


@task("durable.five_steps")
def five_steps(payload: dict, ctx: Any) -> dict:
    """Five checkpointed steps; the first run of step payload["hang_step"] hangs."""
    out = {}
    for n in range(1, 6):
        hang = payload.get("hang", 0) if n == payload.get("hang_step") else 0
        out[f"s{n}"] = ctx.step(f"s{n}", _counted_step, payload["dir"], n, hang)
    return out


@task("durable.many_steps")
def many_steps(payload: dict, ctx: Any) -> int:
    for n in range(payload["steps"]):
        ctx.step(f"s{n}", lambda n=n: n)
    return payload["steps"]


@task("durable.bad_step")
def bad_step(payload: dict, ctx: Any) -> Any:
    ctx.step("ok", lambda: 1)
    return ctx.step(
        "bad", lambda: {"ratio": float("nan")} if payload["kind"] == "nan" else "a\x00b"
    )


@task("durable.sleeper", durable=True)
def sleeper(payload: dict, ctx: Any) -> dict:
    """step, durable sleep, step: the second step runs after the sleep."""
    before = ctx.step("before", lambda: count_run(payload["dir"], "before"))
    ctx.sleep(payload["seconds"])
    after = ctx.step("after", lambda: (count_run(payload["dir"], "after"), time.time()))
    return {"before": before, "after": after}


@task("durable.approval")
def approval(payload: dict, ctx: Any) -> dict:
    """Waits for the signal "approval"; a timeout is caught and reported."""
    ctx.step("prepare", lambda: count_run(payload["dir"], "prepare"))
    try:
        got = ctx.wait_for_signal("approval", timeout=payload.get("timeout"))
    except Exception as exc:  # SignalTimeout: go on without the approval
        return {"timed_out": True, "error": str(exc), "class": type(exc).__name__}
    return {"approved": got, "prepare_runs": runs(payload["dir"], "prepare")}


@task("durable.signal_after_step")
def signal_after_step(payload: dict, ctx: Any) -> Any:
    """Hangs in a step until a file appears, then waits for the signal "go"."""

    def gate() -> int:
        deadline = time.monotonic() + 30
        while not (Path(payload["dir"]) / "gate").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return 1

    ctx.step("gate", gate)
    return ctx.wait_for_signal("go", timeout=30)
