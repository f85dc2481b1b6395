"""Every attempt ends, whatever its handler does: timeouts and lost handlers (issue 27).

A lease is renewed by the worker's heartbeat, so a handler that hangs, or a handler
thread that died without a result, would hold its job `processing` for ever. The
worker asks this module, a few times a second, what each running attempt needs:

- SOFT: it reached its timeout: `ctx.timed_out` is set and `ctx.stop` too, so a
  cooperative handler returns (the attempt still fails with a `timeout:` error);
- TIMEOUT: it is still running `JOBS_TIMEOUT_GRACE` seconds later: the worker ends
  the attempt failed (retried per its budget, lease bumped by the fenced write) and
  gives its slot to a new handler thread; the stuck one is abandoned;
- LOST: its handler thread (or child process) is gone without a result: failed at once.

The heartbeat renews only attempts `renewable()` says are alive and within their
timeout plus grace (D82-D84).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Protocol

from jobs.conf import settings

TIMEOUT_PREFIX = "timeout:"


class Verdict(enum.StrEnum):
    SOFT = "soft"  # tell the handler to stop (ctx.timed_out, ctx.stop)
    TIMEOUT = "timeout"  # end the attempt: past its timeout plus the grace
    LOST = "lost_handler"  # its handler ended without a result


class AttemptTimeout(TimeoutError):
    """Stands for the class of an attempt the worker ended at its timeout: a
    TimeoutError, so a task's `retry_on=(TimeoutError,)` covers it."""


class HandlerLost(Exception):
    """Stands for the class of an attempt whose handler ended without a result."""


class Watched(Protocol):
    """What the watchdog reads of a running attempt."""

    deadline: float | None  # monotonic time of the soft stop; None: no timeout
    ctx: Any

    def handler_alive(self) -> bool: ...


def limit_seconds(job_timeout: float | None, task_timeout: float | None) -> float | None:
    """Seconds one attempt may run: the job's own timeout, else its task's, else
    JOBS_DEFAULT_TIMEOUT (0: none), never more than JOBS_MAX_TIMEOUT."""
    for value in (job_timeout, task_timeout, settings.JOBS_DEFAULT_TIMEOUT):
        if value is not None:
            break
    if not value or value <= 0:
        return None
    return min(float(value), float(settings.JOBS_MAX_TIMEOUT))


def grace_seconds() -> float:
    return max(0.0, float(settings.JOBS_TIMEOUT_GRACE))


def examine(running: Iterable[Watched], now: float, grace: float) -> list[tuple[Any, Verdict]]:
    """What each running attempt needs now (nothing for most)."""
    found = []
    for item in running:
        if not item.handler_alive():
            found.append((item, Verdict.LOST))
        elif item.deadline is None:
            continue
        elif now >= item.deadline + grace:
            found.append((item, Verdict.TIMEOUT))
        elif now >= item.deadline and not item.ctx.timed_out:
            found.append((item, Verdict.SOFT))
    return found


def renewable(item: Watched, now: float, grace: float) -> bool:
    """Whether the heartbeat may extend this attempt's lease: its handler is alive and
    within its timeout plus grace (a hung handler must not keep its job for ever)."""
    if not item.handler_alive():
        return False
    return item.deadline is None or now < item.deadline + grace


def timeout_error(limit: float, grace: float) -> str:
    return (
        f"{TIMEOUT_PREFIX} the attempt exceeded its {limit:g}s timeout "
        f"(ended {grace:g}s later, the grace, still running)"
    )


def timed_out_error(limit: float) -> str:
    """A handler that returned (or raised) after being told its time was up."""
    return f"{TIMEOUT_PREFIX} the attempt exceeded its {limit:g}s timeout (stopped on request)"


def lost_error(what: str) -> str:
    return f"handler lost: {what} ended without a result"
