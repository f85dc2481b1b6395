"""Handlers that misbehave towards their worker (issue 27), for the end-to-end tests and
the fault suite: JOBS_TASK_MODULES=tests.containment_tasks."""

from __future__ import annotations

import os
import signal
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


# --- the process pool (runworker --pool processes) -------------------------------------


@task("contain.pid")
def pid(payload: Any, ctx: JobContext) -> int:
    """The process that ran the handler."""
    return os.getpid()


@task("contain.os_exit")
def os_exit(payload: Any, ctx: JobContext) -> None:
    os._exit(1)


@task("contain.kill9")
def kill9(payload: Any, ctx: JobContext) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@task("contain.grow")
def grow(payload: dict, ctx: JobContext) -> int:
    """Keeps `mb` megabytes alive in its process (a leak), returns the pid."""
    _leak.append(bytearray(payload["mb"] * 2**20))
    return os.getpid()


_leak: list[bytearray] = []


@task("contain.report")
def report(payload: dict, ctx: JobContext) -> dict:
    """Progress, a step, a signal read and the cancel flag, seen from the handler."""
    ctx.progress(1, 2, "half")
    stepped = ctx.step("one", lambda: payload.get("value", 1))
    if payload.get("wait_cancel"):
        Path(payload["wait_cancel"]).write_text("running")
        ctx.stop.wait(HANG_LIMIT)
        return {"cancelled": ctx.cancelled}
    if payload.get("signal"):
        return {"pid": os.getpid(), "signal": ctx.wait_for_signal(payload["signal"])}
    if payload.get("hold"):
        time.sleep(payload["hold"])
    return {"pid": os.getpid(), "step": stepped}


@task("contain.spin")
def spin(payload: dict, ctx: JobContext) -> int:
    """Pure-Python CPU work (holds the GIL): `n` loop turns."""
    total = 0
    for i in range(payload.get("n", 1_000_000)):
        total += i & 7
    return total


@task("contain.tx_pid", transactional=True)
def tx_pid(payload: Any, ctx: JobContext) -> int:
    """Transactional: the process its transaction (and completion) ran in."""
    return os.getpid()


@task("contain.tx_hang", transactional=True, timeout=1)
def tx_hang(payload: Any, ctx: JobContext) -> str:
    """Transactional and ignoring ctx.stop: in the process pool it runs in the parent."""
    time.sleep(payload.get("seconds", 10))
    return "woke up"


@task("contain.local_str")
def local_str(payload: dict, ctx: JobContext) -> str:
    """Notes its call, returns an instance of a class defined in the handler: JSON takes
    it (a str), pickle cannot carry it out of a process-pool child."""

    class Label(str):
        pass

    with open(payload["calls"], "a") as f:
        f.write(f"{os.getpid()}\n")
    return Label("labelled")


@task("contain.hold")
def hold(payload: dict, ctx: JobContext) -> int:
    """Notes each call in `calls` (one line per attempt), then holds until the file `go`
    exists or it is told to stop."""
    with open(payload["calls"], "a") as f:
        f.write(f"{ctx.attempt}\n")
    go = Path(payload["go"])
    until = time.monotonic() + HANG_LIMIT
    while not go.exists() and time.monotonic() < until and not ctx.stop.wait(0.05):
        pass
    return os.getpid()
