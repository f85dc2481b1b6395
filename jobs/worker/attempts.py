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
from dataclasses import dataclass, field
from typing import Any

from django.db import (
    DataError,
    IntegrityError,
)

from jobs.errors import storable
from jobs.lifecycle import Status
from jobs.services import Lease
from jobs.tasks import JobContext, PermanentError

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


class InvalidResult(PermanentError):
    """The handler returned something the result column (jsonb) cannot store."""


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
    # Ended by the watchdog: whatever its handler returns later is dropped.
    abandoned: bool = False

    def handler_alive(self) -> bool:
        return self.thread is None or self.thread.is_alive()


def _key(lease: Lease) -> tuple[int, int]:
    return (lease.job_id, lease.lease_version)


class _FenceRejected(Exception):
    """Raised inside a transactional completion to roll back a stale worker's effects."""


class _Cancelled(Exception):
    """Raised inside a transactional handler's transaction when it saw a cancel request."""
