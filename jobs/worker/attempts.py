"""What the worker's rooms share: constants, an attempt in flight, its outcome, and the
result check a handler's return value passes."""

from __future__ import annotations

import enum
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import (
    DataError,
    IntegrityError,
)

from jobs import durable, tasks
from jobs.errors import AttemptError, PerKeyRateLimit, log_failed_attempt, storable
from jobs.lifecycle import Status
from jobs.observability import hooks
from jobs.services import Lease
from jobs.tasks import InvalidPayload, JobContext, PermanentError

log = logging.getLogger("jobs.worker")

DB_BACKOFF_MAX = 10.0
REDIS_BACKOFF_MAX = 30.0
MAX_BATCH = 1000
HEALTH_CHECK_EVERY = 1.0  # seconds between the dispatcher's connection health checks
# Prefetch: a worker claims ahead what its threads can finish within this fraction of
# the lease (1 s at the default 15 s), learnt from run times; long jobs get no prefetch.
PREFETCH_WINDOW_FRACTION = 1 / 15
# Run-time estimate: learns a longer run at once (half way), a shorter one slowly.
RUN_TIME_UP, RUN_TIME_DOWN = 0.5, 0.05
MAX_PREFETCH = MAX_BATCH  # the most --prefetch accepts: one claim statement's batch
STALE_CHECK_EVERY = 0.25  # seconds between looks for prefetched jobs waiting too long
# Longest an idle worker's dispatcher waits, after handing a claim to a handler, for its
# write-back to start before looking for more work (D74): a no-op job needs ~0.3 ms.
IDLE_HANDOFF_WAIT = 0.002
# Frames of the worker's own code (either pool) are left out of a handler's traceback.
WORKER_DIR = os.path.dirname(__file__) + os.sep
WATCHDOG_TICK = 0.25  # seconds between the watchdog's looks at running attempts


# Errors that come from a row's content, not from the connection or the server:
# psycopg's client-side refusals (NUL in text, a lone surrogate) and PostgreSQL's
# data and constraint errors. Retrying the same rows cannot help.
_ROW_DATA_ERRORS = (DataError, IntegrityError, UnicodeError, TypeError, ValueError)


def _first_line(exc: BaseException) -> str:
    return storable(str(exc).strip().split("\n", 1)[0])[:500]


def new_worker_id() -> str:
    """host:pid:random — unique per process, stored in owned_by and the history."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class InvalidResult(PermanentError, TypeError):
    """The handler returned something the result column (jsonb) cannot store: a
    TypeError, as Django's own Tasks backends record such a return value (D226)."""


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(v) for v in value)
    return False


def check_result(result: Any) -> Any:
    """Raise InvalidResult unless `result` can be written as jsonb.

    Checked in the handler's thread, so one bad result fails its own job instead
    of the batched write-back that carries other jobs' results too.
    """
    try:
        text = json.dumps(result, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidResult(f"not JSON-serializable ({exc})") from exc
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = storable(exc.object[exc.start : exc.end])
            raise InvalidResult(f"not valid UTF-8 (lone surrogate {bad})") from None
    if _has_nul(result):
        raise InvalidResult("contains a NUL character, which PostgreSQL cannot store")
    return result


class OutcomeKind(enum.StrEnum):
    """What an attempt ended with; the flusher writes one statement per kind."""

    DONE = Status.DONE.value  # to write back as completed (the status it becomes)
    FAIL = "fail"  # to write back as failed (retry or terminal, by the lifecycle)
    RELEASE = "release"  # to hand back to the queue unrun (shutdown)
    SETTLED = "settled"  # already written (transactional handlers) or rejected: forget it


@dataclass
class Outcome:
    """What one attempt ended with, waiting to be written back."""

    lease: Lease
    kind: OutcomeKind
    result: Any = None
    error: str = ""
    permanent: bool = False
    error_class: str | None = None
    traceback: str | None = None
    retry_after: float | None = None  # RetryableError(retry_after=...): not before
    # The task's retry policy chose this delay (replacing the global backoff) and says
    # why in `retry_reason`, which goes to the history (jobs.retries).
    retry_delay: float | None = None
    retry_reason: str | None = None


@dataclass(eq=False)
class InFlight:
    lease: Lease
    ctx: JobContext
    started: float = field(default_factory=time.monotonic)  # claimed at
    finishing: bool = False  # its outcome is queued for write-back: heartbeats ignore it
    # Prefetched, no handler has taken it yet: released unrun at shutdown or when it
    # waited too long; `running_since` is set when a handler takes it.
    waiting: bool = False
    running_since: float | None = None
    marked: bool = False  # its claim marked it started (D77); else jobs.starts does
    progress_saved: int = 0  # sequence number of the last progress report written
    progress_written_at: float = float("-inf")
    # Set when a handler takes it (jobs.watchdog): the thread running it, the seconds it
    # may run and when that is up (monotonic; None: no timeout).
    thread: threading.Thread | None = None
    limit: float | None = None
    deadline: float | None = None
    # Ended by the watchdog: whatever its handler returns later is dropped; `replaced`:
    # a new thread took its slot, so the one running it leaves the pool when it returns.
    abandoned: bool = False
    replaced: bool = False

    def handler_alive(self) -> bool:
        return self.thread is None or self.thread.is_alive()


def _key(lease: Lease) -> tuple[int, int]:
    return (lease.job_id, lease.lease_version)


class _FenceRejected(Exception):
    """Raised inside a transactional completion to roll back a stale worker's effects."""


class _Cancelled(Exception):
    """Raised inside a transactional handler's transaction when it saw a cancel request."""


def unknown_task(lease: Lease) -> Outcome:
    return Outcome(
        lease, OutcomeKind.FAIL, error=storable(f"unknown task {lease.task!r}"), permanent=True
    )


def call_handler(spec: tasks.TaskSpec, lease: Lease, ctx: JobContext) -> Outcome:
    """Validate the payload, run the handler, check its result: in either pool."""
    if spec.validate is not None:
        spec.validate(lease.payload)
    return Outcome(lease, OutcomeKind.DONE, result=check_result(spec.fn(lease.payload, ctx)))


def guarded(
    lease: Lease,
    spec: tasks.TaskSpec,
    ctx: JobContext,
    run: Callable[[tasks.TaskSpec, Lease, JobContext], Outcome],
    failed: Callable[..., Outcome],
    park: Callable[[Lease, JobContext, durable.Suspend], Outcome],
) -> Outcome:
    """`run(spec, lease, ctx)`'s outcome, whatever the handler raises (BaseException
    included): the one mapping of handler exceptions to outcomes, in either pool."""
    try:
        return run(spec, lease, ctx)
    except durable.Suspend as wait:
        return park(lease, ctx, wait)
    except durable.FencedOff:  # a stale checkpoint, refused and recorded
        hooks.ended(lease, "step", stale=True)
        return Outcome(lease, OutcomeKind.SETTLED)
    except InvalidPayload as exc:
        return failed(lease, exc, True, f"invalid payload: {exc}")
    except InvalidResult as exc:
        return failed(lease, exc, True, f"invalid result: {exc}")
    except PermanentError as exc:
        return failed(lease, exc, True)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the worker goes on
        if spec.retry is None:
            return failed(lease, exc, False)
        return by_policy(spec, lease, exc, failed)


def by_policy(
    spec: tasks.TaskSpec, lease: Lease, exc: BaseException, failed: Callable[..., Outcome]
) -> Outcome:
    """A failed attempt as the task's retry policy decides: at once, or retried after
    the policy's delay, with the reason for the history."""
    try:
        decision = spec.retry.decide(exc, lease.retry_count + 1)
    except Exception as broken:  # a backoff callable that raised: the default backoff
        log.warning("retry policy of %s failed: %s", lease.task, broken, extra=lease.log_fields())
        return failed(lease, exc, False)
    outcome = failed(lease, exc, decision.give_up)
    outcome.permanent = decision.give_up
    outcome.retry_delay = decision.delay
    outcome.retry_reason = storable(decision.reason)
    return outcome


def failed_outcome(
    limiter: PerKeyRateLimit,
    lease: Lease,
    exc: BaseException,
    permanent: bool,
    message: str | None = None,
) -> Outcome:
    """A failed attempt: storable error text, class and traceback, logged (rate-limited)."""
    err = AttemptError.of(exc, message, skip_from=WORKER_DIR)
    hooks.failed(lease, exc, err.error_class)
    log_failed_attempt(
        log, limiter, lease.task, exc, err.message,
        lease.log_fields(permanent=permanent, error_class=err.error_class),
    )  # fmt: skip
    return Outcome(
        lease,
        OutcomeKind.FAIL,
        error=err.message,
        permanent=permanent,
        error_class=err.error_class,
        traceback=err.traceback,
        retry_after=getattr(exc, "retry_after", None),
    )
