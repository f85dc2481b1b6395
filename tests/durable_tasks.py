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


def _log_step(directory: str, i: int, job_id: int, lease_version: int) -> int:
    """One line per run of iteration i's step ("i job lease"), in one append-only file:
    a run under a later lease than the committed one would be a committed step run twice."""
    with (Path(directory) / "loop-steps").open("a") as f:
        f.write(f"{i} {job_id} {lease_version}\n")
    return i


@task("durable.loop", durable=True)
def loop(payload: dict, ctx: Any) -> dict:
    """A long-lived loop (issue 45): a step and a durable sleep per iteration, and
    continue-as-new every payload["every"] iterations, carrying the count forward."""
    start = i = payload.get("i", 0)
    while i < payload["total"]:
        ctx.step(f"it-{i}", _log_step, payload["dir"], i, ctx.job_id, ctx.lease_version)
        ctx.sleep(payload.get("sleep", 0))
        i += 1
        if i - start >= payload["every"] and i < payload["total"]:
            ctx.continue_as_new({**payload, "i": i})
    return {"i": i, "run_started_at": start}


@task("durable.chained_signal", durable=True)
def chained_signal(payload: dict, ctx: Any) -> Any:
    """Run 1 continues as new at once; run 2 waits for the signal "go"."""
    if payload.get("run", 1) == 1:
        ctx.step("first", lambda: 1)
        ctx.continue_as_new({"run": 2})
    return ctx.wait_for_signal("go", timeout=60)


# The code version the "durable.versioned" task runs (tests change it between attempts,
# as a deploy changes a task under a parked job).
VERSION = {"v": 1}


@task("durable.versioned", durable=True)
def versioned(payload: dict, ctx: Any) -> dict:
    a = ctx.step("a", lambda: "a")
    if VERSION["v"] == 1:
        b = ctx.step("b", lambda: "old")
    elif VERSION["v"] == 2:  # the step renamed: replaying an old run is nondeterministic
        b = ctx.step("b-renamed", lambda: "renamed")
    elif ctx.patched("new-b"):  # v3: new runs take the new branch, old runs the old one
        b = ctx.step("b-new", lambda: "new")
    else:
        b = ctx.step("b", lambda: "old")
    ctx.sleep(payload.get("sleep", 0))
    c = ctx.step("c", lambda: "c")
    return {"a": a, "b": b, "c": c}


def _logged_run(directory: str, n: int, job_id: int, lease_version: int, seconds: float) -> list:
    """Step n's run, one line ("job step lease") in one append-only file shared by every
    worker: a run under a later lease than its committed checkpoint's would be a
    committed step run again."""
    with (Path(directory) / "step-runs").open("a") as f:
        f.write(f"{job_id} s{n} {lease_version}\n")
    time.sleep(seconds)
    return [n, lease_version]


@task("durable.logged_steps")
def logged_steps(payload: dict, ctx: Any) -> list:
    """Five steps that log each run of their function (the async checkpoint fault test)."""
    return [
        ctx.step(
            f"s{n}",
            _logged_run,
            payload["dir"],
            n,
            ctx.job_id,
            ctx.lease_version,
            payload.get("seconds", 0),
        )  # fmt: skip
        for n in range(1, 6)
    ]
