"""The worker: discover, claim, run, and write back under the fence (SPEC §1, §3, §4).

One process runs one dispatcher (this module's `Worker.run`, on the main
thread), `concurrency` handler threads fed from one queue, a flusher that writes
finished attempts back in batches, a heartbeat thread that extends every
held lease in one statement, and a starter that records prefetched attempts' starts
(jobs.starts, D77). Redis ids are hints: a popped id says only "queue q
has work", and the dispatcher claims the best due rows of q in PostgreSQL's order
(priority DESC, run_at, id), one per id popped. It falls back to claiming
straight from Postgres whenever Redis is silent, down or not configured. Queues
are visited in a weighted random order (jobs.dispatch), so none starves.

Prefetch: for short jobs a claim takes more than the free threads, what they finish
within 1/15 of the lease at the measured run time (bounded by --prefetch); the
jobs wait in a priority heap, and those no thread has taken are released unrun at
shutdown or when long jobs keep them waiting (D67).

Batching never merges authority: each row of a batched write carries its own
(id, lease_version, owned_by) and status = 'processing' predicate, so one stale
entry is rejected alone while the others land. The flusher batches by natural
group commit: it writes whatever finished while the previous write was in
flight, so an idle worker writes one result at once and a busy one writes many
per statement, without a fixed wait (`flush_interval` adds one, default 0).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import json
import logging
import os
import queue as queue_mod
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import (
    DatabaseError,
    DataError,
    IntegrityError,
    InterfaceError,
    close_old_connections,
    connection,
    transaction,
)

from jobs import durable, metrics, selectors, services, tasks
from jobs.conf import settings
from jobs.dispatch import QueueSpec, parse_queues, polling_order
from jobs.errors import (
    MAX_ERROR_CHARS,
    AttemptError,
    PerKeyRateLimit,
    class_path,
    log_failed_attempt,
    storable,
)
from jobs.lifecycle import CANCELLED, TERMINAL, Status
from jobs.presence import Presence
from jobs.queuecontrol import Gate
from jobs.queues import BUILTIN as BUILTIN_QUEUES
from jobs.runtime import Backoff, StopRequests
from jobs.services import Lease
from jobs.starts import Starter, Verdict
from jobs.tasks import InvalidPayload, JobContext, PermanentError
from jobs.transport import TransportError, get_transport

log = logging.getLogger(__name__)

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


def _key(lease: Lease) -> tuple[int, int]:
    return (lease.job_id, lease.lease_version)


class _FenceRejected(Exception):
    """Raised inside a transactional completion to roll back a stale worker's effects."""


class _Cancelled(Exception):
    """Raised inside a transactional handler's transaction when it saw a cancel request."""


class Worker:
    """Runs jobs from the given queues until told to stop.

    First `request_stop()`: stop claiming, let running jobs finish within
    `grace` seconds, release the rest (fenced, lease bumped), exit. Second:
    exit at once; leases still held are recovered by the reaper.
    """

    def __init__(
        self,
        queues: list[str] | QueueSpec | None = None,
        concurrency: int = 4,
        *,
        burst: bool = False,
        max_jobs: int | None = None,
        grace: float = 10.0,
        poll_interval: float = 1.0,
        lease_seconds: float | None = None,
        flush_interval: float = 0.0,
        worker_id: str | None = None,
        progress_interval: float | None = None,
        prefetch: int | None = None,
    ) -> None:
        if not isinstance(queues, QueueSpec):
            queues = parse_queues(",".join(queues or ["default"]))
        self.spec = queues
        self.queues = list(queues.names)
        self.concurrency = max(1, concurrency)
        self.burst = burst
        self.max_jobs = max_jobs
        self.grace = grace
        self.poll_interval = poll_interval
        self.lease_seconds = lease_seconds or settings.JOBS_LEASE_SECONDS
        self.heartbeat_interval = max(0.2, self.lease_seconds / 3)
        if progress_interval is None:
            progress_interval = settings.JOBS_PROGRESS_INTERVAL
        self.progress_interval = max(0.05, progress_interval)
        self.flush_interval = flush_interval
        if prefetch is None:
            prefetch = settings.JOBS_WORKER_PREFETCH
        self.max_prefetch = max(0, prefetch)
        self.prefetch_window = self.lease_seconds * PREFETCH_WINDOW_FRACTION
        # Weights share claims between queues one claim at a time (jobs.dispatch): a
        # worker serving several queues claims for its free threads only, so the shares
        # hold per job, not per batch of a hundred.
        # The built-in queues (webhook deliveries) do not count: the default worker
        # serves `default,webhooks`.
        own = [q for q in self.spec.weights if q not in BUILTIN_QUEUES]
        self._several_queues = len(own) > 1 or self.spec.serves_all
        self._run_time: float | None = None  # estimated seconds per job; None: not measured
        self._long_running = 0  # handlers busy for longer than the prefetch window
        self._long_at = float("-inf")
        self._stale_at = float("-inf")
        self.worker_id = worker_id or new_worker_id()
        self.transport = get_transport()

        self.stopping = threading.Event()  # no more claims
        self.halt = threading.Event()  # background threads end
        # Claimed and not yet written back, by (job id, lease_version): the same job may be
        # claimed again by this worker (after a revoke or reap) while the stale attempt's
        # result still waits for write-back; the two must never be confused.
        self._inflight: dict[tuple[int, int], InFlight] = {}
        self._running = 0  # of those, the ones whose handler has not returned yet
        self._waiting = 0  # prefetched: claimed, not yet taken by a handler
        self._lock = threading.Lock()
        self._slot_free = threading.Event()
        self._quiet = threading.Event()  # set when a write-back starts (see _start)
        # Claimed jobs wait in a heap (priority DESC, then claim order) under `_lock`, so a
        # job claimed later with a higher priority starts before prefetched lower ones;
        # `_ready` carries one token per entry to wake a handler thread (None: exit).
        self._heap: list[tuple[int, int, InFlight]] = []
        self._seq = itertools.count()
        self._ready: queue_mod.SimpleQueue[bool | None] = queue_mod.SimpleQueue()
        self._outcomes: queue_mod.SimpleQueue[Outcome] = queue_mod.SimpleQueue()
        self._debug = log.isEnabledFor(logging.DEBUG)
        # Tracebacks of failed attempts: 5 per task at once, then one per 12 s.
        self._traceback_log = PerKeyRateLimit(burst=5, every=12.0)
        self._released: set[tuple[int, int]] = set()
        self.claimed = 0
        self.finished = 0
        self._finished_lock = threading.Lock()  # handler threads and the flusher add
        self._stops = StopRequests(self._warm_stop, self._cold_stop)
        self._pg_had_work = False
        self._redis_down_until = 0.0
        self._redis_backoff = Backoff(0.5, REDIS_BACKOFF_MAX)
        self._db_backoff = Backoff(0.2, DB_BACKOFF_MAX)
        self._found: list[str] = []  # queues with work, for a worker serving `*`
        self._found_at = float("-inf")
        self.gate = Gate()  # queue controls: pause, cap, rate, weight (jobs.queuecontrol)
        # Start marks, and a look at the prefetched leases (jobs.starts).
        self.starter = Starter(
            self.worker_id, self.halt, self._prefetched, self.prefetch_window / 2
        )

    # --- control ------------------------------------------------------------------

    def request_stop(self) -> None:
        """First call: warm stop. Second: raises ColdStop (from a signal handler, in the
        main thread, so run()'s `finally` still closes connections and unregisters)."""
        self._stops.request()

    def install_signal_handlers(self) -> None:
        self._stops.install()

    def _warm_stop(self) -> None:
        log.info("worker stopping: finishing in-flight jobs", extra={"worker_id": self.worker_id})
        self.stopping.set()

    def _cold_stop(self) -> None:
        log.warning(
            "worker exiting now; held leases will be reaped", extra={"worker_id": self.worker_id}
        )
        self.stopping.set()
        self.halt.set()

    def _count_finished(self, n: int) -> None:
        with self._finished_lock:
            self.finished += n

    @property
    def inflight(self) -> int:
        """Leases held: prefetched, running and awaiting write-back
        (≤ 2 × max(concurrency, prefetch))."""
        with self._lock:
            return len(self._inflight)

    @property
    def running(self) -> int:
        """Busy handler threads (≤ concurrency): what saturation is measured against."""
        with self._lock:
            return self._running

    # --- main loop -------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped (or, with burst/max_jobs, until done); returns jobs finished."""
        log.info(
            "worker started",
            extra={
                "worker_id": self.worker_id,
                "queues": self.queues,
                "concurrency": self.concurrency,
            },
        )
        tasks.load()
        # Registered (and, with session crash detection, locked) before the first claim.
        presence = Presence(self.worker_id, self.queues, self.concurrency)
        presence.start()
        handlers = [
            threading.Thread(target=self._handler_loop, name=f"job_{n}", daemon=True)
            for n in range(self.concurrency)
        ]
        flusher = threading.Thread(target=self._flush_loop, name="flusher", daemon=True)
        beater = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        for thread in (*handlers, flusher, beater):
            thread.start()
        self.starter.start()
        checked = 0.0
        try:
            while not self.stopping.is_set():
                now = time.monotonic()
                if now - checked >= HEALTH_CHECK_EVERY:
                    # Not every loop: with CONN_HEALTH_CHECKS each call costs a round trip.
                    close_old_connections()
                    checked = now
                if self.max_jobs is not None and self.claimed >= self.max_jobs:
                    break
                if self._waiting and now - self._stale_at >= STALE_CHECK_EVERY:
                    self._stale_at = now
                    self._release_unstarted(self.prefetch_window * 2)
                # Cleared before counting, so a slot freed from here on wakes the wait below.
                self._slot_free.clear()
                free = self._claim_size()
                if self.max_jobs is not None:
                    free = min(free, self.max_jobs - self.claimed)
                if free <= 0:
                    self._slot_free.wait(0.1)
                    continue
                # The jobs this claim hands straight to idle threads are marked started by
                # the claim; prefetched ones when a thread takes them (D77).
                start = self._idle_threads()
                leases = self._discover(free, start)
                if leases is None:
                    continue
                if not leases and self.burst and self.inflight == 0 and self._outcomes.empty():
                    break
                self._start(leases, marked=start)
            self._drain()
        finally:
            self.halt.set()
            for _ in handlers:
                self._ready.put(None)
            # A cold stop does not wait for a write-back in flight: the reaper has it.
            flusher.join(timeout=1 if self._stops.cold else 30)
            beater.join(timeout=1 if self._stops.cold else 5)
            self.starter.join(timeout=1)
            presence.stop()
            connection.close()
        log.info("worker stopped", extra={"worker_id": self.worker_id, "finished": self.finished})
        return self.finished

    def _weights(self) -> dict[str, float]:
        """The queues to poll now with their weights (`*` adds every queue with work)."""
        if self.spec.serves_all and time.monotonic() - self._found_at >= self.poll_interval:
            self._found = selectors.queued_queues()
            self._found_at = time.monotonic()
        return self.spec.with_queues(self._found, self.gate.weights())

    def _discover(self, free: int, start: int | None = None) -> list[Lease] | None:
        """Claim up to `free` jobs. None means "nothing, loop again at once".

        A pop of k ids from queue q claims the k best due rows of q (not those ids):
        Redis says when to look, PostgreSQL says what runs first. An id that finds
        no row (claimed by someone else already) counts as a duplicate delivery.
        """
        try:
            order = self.gate.open(polling_order(self._weights()))
            leases = self.gate.claim_pending(self.worker_id, order, free, start=start)
            if leases:
                return leases
            order = self.gate.open(order)  # less any queue that claim found blocked again
            if not order:  # serving `*` and no queue has work, or every queue paused or limited
                wake = self.gate.wake_in()
                if wake is not None:  # a slot this worker frees may end a cap's wait sooner
                    self._slot_free.wait(wake)
                    return None
                self.stopping.wait(self.poll_interval if not self.burst else 0)
                return []
            if self.transport.enabled and time.monotonic() >= self._redis_down_until:
                try:
                    timeout = 0 if self._pg_had_work else self.gate.wake_in(self.poll_interval)
                    queue, ids = self.transport.pop(order, timeout, free)
                    self._redis_backoff.reset()
                except TransportError as exc:
                    down_for = self._redis_backoff.next()
                    self._redis_down_until = time.monotonic() + down_for
                    log.warning(
                        "redis unavailable, claiming from postgres for %.1fs: %s",
                        down_for,
                        exc,
                        extra={"worker_id": self.worker_id},
                    )
                    ids = []
                if ids:
                    leases = self.gate.claim_next(self.worker_id, [queue], len(ids), start=start)
                    dupes = len(ids) - len(leases)
                    if dupes and not self.gate.held_back(queue):  # held back: not duplicates
                        metrics.child(metrics.DUPLICATE_DELIVERIES, queue).inc(dupes)
                    self._db_backoff.reset()
                    if leases:
                        return leases
                    return None
            leases = self.gate.claim_next(self.worker_id, order, free, start=start)
            self._db_backoff.reset()
            self._pg_had_work = len(leases) == free
            if not leases and (not self.transport.enabled or self._redis_down()):
                self.stopping.wait(self.poll_interval if not self.burst else 0)
            return leases
        except (DatabaseError, InterfaceError) as exc:
            metrics.child(metrics.DB_ERRORS, "claim").inc()
            wait = self._db_backoff.next()
            log.warning(
                "postgres unavailable for claims, retrying in %.1fs: %s",
                wait,
                exc,
                extra={"worker_id": self.worker_id},
            )
            connection.close()
            self.stopping.wait(wait)
            return None

    def _redis_down(self) -> bool:
        return time.monotonic() < self._redis_down_until

    # --- running a job ------------------------------------------------------------------

    def _prefetched(self) -> list[tuple[Lease, JobContext]]:
        with self._lock:
            return [(i.lease, i.ctx) for i in self._inflight.values() if i.waiting]

    def _idle_threads(self) -> int:
        """How many of a claim's best jobs idle threads take at once (none while
        prefetched jobs wait: they go first)."""
        with self._lock:
            return 0 if self._waiting else max(0, self.concurrency - self._running)

    def _start(self, leases: list[Lease], marked: int = 0) -> None:
        """Hand a claimed batch to the handler threads (one lock round for the batch);
        the first `marked` were marked started by their claim."""
        claimed = []
        for n, lease in enumerate(leases):
            ctx = durable.context(lease)  # a JobContext with steps and waits (issue 17)
            claimed.append(InFlight(lease, ctx, waiting=True, marked=n < marked))
        seq = self._seq
        with self._lock:
            # Nothing else claimed, running or awaiting write-back.
            idle = bool(claimed) and not self._inflight
            for item in claimed:
                self._inflight[_key(item.lease)] = item
                heapq.heappush(self._heap, (-item.lease.priority, next(seq), item))
            self._waiting += len(claimed)
        self.claimed += len(leases)
        put = self._ready.put
        if idle:
            self._quiet.clear()
        for item in claimed:
            if self._debug:
                log.debug("claimed", extra=item.lease.log_fields())
            put(True)
        if idle:
            # An idle worker's claim: step aside (the GIL) until its jobs' write-back
            # is on its way, so the handler and the flusher do not wait behind this
            # loop's Python on their way to the next pop (D74).
            self._quiet.wait(IDLE_HANDOFF_WAIT)

    def _handler_loop(self) -> None:
        get = self._ready.get
        lock = self._lock
        heap = self._heap
        pop = heapq.heappop
        while True:
            if get() is None:
                return
            with lock:  # one token per heap entry: the heap is not empty
                item = pop(heap)[2]
                if not item.waiting:  # released unrun meanwhile (shutdown, waited too long)
                    continue
                item.waiting = False
                item.running_since = time.monotonic()
                self._waiting -= 1
                self._running += 1
            # A session the server ended while this thread was idle or in its last job
            # is replaced before its next handler's ORM calls meet it.
            close_old_connections()
            if self._admit(item):
                self._run_one(item.lease, item.ctx)

    def _admit(self, item: InFlight) -> bool:
        """Record a prefetched attempt's start (before its handler runs where a crash
        charge would decide, D77); a revoked or cancelled one is dropped unrun (D78)."""
        verdict = self.starter.admit(item.lease, item.ctx, item.marked)
        if verdict == Verdict.CANCELLED:
            self._settle(Outcome(item.lease, OutcomeKind.FAIL, error=CANCELLED, permanent=True))
        elif verdict != Verdict.RUN:
            self._forget([item.lease])
        return verdict == Verdict.RUN

    def _run_one(self, lease: Lease, ctx: JobContext) -> None:
        started = time.monotonic()
        outcome = self._execute(lease, ctx)
        durable.observe_steps(lease, ctx)
        took = time.monotonic() - started
        metrics.child(metrics.DURATION, lease.queue, lease.task).observe(took)
        self._learn_run_time(took)
        if (
            outcome.kind in (OutcomeKind.DONE, OutcomeKind.FAIL)
            and ctx.cancel_seen
            and not ctx.lost_authority
        ):
            # The handler saw the cancel request and returned or raised: cancelled, no retry.
            log.info("cancelled: the handler stopped on request", extra=lease.log_fields())
            outcome = Outcome(
                lease,
                OutcomeKind.FAIL,
                error=CANCELLED,
                permanent=True,
                error_class=outcome.error_class,
                traceback=outcome.traceback,
            )
        elif (
            outcome.kind == OutcomeKind.FAIL
            and ctx.stop.is_set()
            and self.stopping.is_set()
            and not ctx.lost_authority
        ):
            # Interrupted by shutdown, not by its own fault: hand it back without a retry.
            outcome = Outcome(lease, OutcomeKind.RELEASE)
        self._settle(outcome)

    def _execute(self, lease: Lease, ctx: JobContext) -> Outcome:
        spec = tasks.get(lease.task)
        if spec is None:
            return Outcome(
                lease,
                OutcomeKind.FAIL,
                error=storable(f"unknown task {lease.task!r}"),
                permanent=True,
            )
        try:
            if spec.validate is not None:
                spec.validate(lease.payload)
            if spec.transactional:
                return self._execute_transactional(spec, lease, ctx)
            return Outcome(
                lease, OutcomeKind.DONE, result=check_result(spec.fn(lease.payload, ctx))
            )
        except durable.Suspend as wait:  # the handler parks its job (jobs.durable)
            self._mark_finishing(lease)  # its heartbeat stops before the lease is bumped
            durable.park(lease, ctx, wait)
            return Outcome(lease, OutcomeKind.SETTLED)
        except durable.FencedOff:  # a stale checkpoint, refused and recorded
            return Outcome(lease, OutcomeKind.SETTLED)
        except InvalidPayload as exc:
            return self._failed(lease, exc, True, f"invalid payload: {exc}")
        except InvalidResult as exc:
            return self._failed(lease, exc, True, f"invalid result: {exc}")
        except PermanentError as exc:
            return self._failed(lease, exc, True)
        except Exception as exc:
            return self._failed(lease, exc, False)

    def _failed(
        self, lease: Lease, exc: Exception, permanent: bool, message: str | None = None
    ) -> Outcome:
        """A failed attempt: storable error text, class and traceback, logged (rate-limited)."""
        err = AttemptError.of(exc, message, skip_from=__file__)
        log_failed_attempt(
            log, self._traceback_log, lease.task, exc, err.message,
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

    def _execute_transactional(
        self, spec: tasks.TaskSpec, lease: Lease, ctx: JobContext
    ) -> Outcome:
        """Handler writes and the fenced completion commit together or not at all."""
        try:
            with transaction.atomic(durable=True):
                result = check_result(spec.fn(lease.payload, ctx))
                if ctx.cancel_seen:
                    raise _Cancelled  # its writes roll back; the job fails "cancelled"
                self._mark_finishing(lease)
                if lease.job_id not in services.complete([(lease, result)]):
                    raise _FenceRejected
        except _FenceRejected:
            services.record_fence_rejections([lease], "complete")
            return Outcome(lease, OutcomeKind.SETTLED)
        except _Cancelled:
            return Outcome(lease, OutcomeKind.FAIL, error=CANCELLED, permanent=True)
        finally:
            connection.close_if_unusable_or_obsolete()
        self._count_finished(1)
        return Outcome(lease, OutcomeKind.SETTLED)

    def _mark_finishing(self, lease: Lease) -> None:
        with self._lock:
            item = self._inflight.get(_key(lease))
            if item is not None and not item.finishing:
                item.finishing = True
                self._running -= 1

    def _settle(self, outcome: Outcome) -> None:
        self.starter.ended(outcome.lease)
        if outcome.kind == OutcomeKind.SETTLED:
            self._forget([outcome.lease])
            self._quiet.set()  # written by the handler itself: an idle dispatcher resumes
        else:
            self._mark_finishing(outcome.lease)
            self._outcomes.put(outcome)
            # A handler thread is free again: the next claim overlaps this write-back.
            self._slot_free.set()

    def _forget(self, leases: list[Lease]) -> None:
        with self._lock:
            for lease in leases:
                item = self._inflight.pop(_key(lease), None)
                if item is None:
                    continue
                if item.waiting:
                    item.waiting = False
                    self._waiting -= 1
                elif not item.finishing:
                    self._running -= 1
        self.gate.freed({lease.queue for lease in leases})
        self._slot_free.set()

    # --- prefetch ------------------------------------------------------------------------

    def _learn_run_time(self, seconds: float) -> None:
        """Move the run-time estimate towards `seconds` (an estimate: a lost update
        between handler threads does no harm)."""
        avg = self._run_time
        if avg is None:
            self._run_time = seconds
        else:
            weight = RUN_TIME_UP if seconds > avg else RUN_TIME_DOWN
            self._run_time = avg + weight * (seconds - avg)

    def _prefetch(self) -> int:
        """Jobs to hold claimed beyond the handler threads: what the threads not stuck
        on a long job finish within the prefetch window at the estimated run time,
        less one each for the job they run; 0 until a run time is measured, for long
        jobs, when every thread runs one, and for a worker serving several queues.
        Running and prefetched jobs together stay within max(concurrency,
        max_prefetch), as a broker's prefetch count bounds unacknowledged deliveries."""
        avg = self._run_time
        room = self.max_prefetch - self.concurrency
        if room <= 0 or avg is None or self._several_queues:
            return 0
        now = time.monotonic()
        if now - self._long_at >= 0.1:  # a scan of the held leases, ten times a second
            self._long_at = now
            since = now - self.prefetch_window
            with self._lock:
                self._long_running = sum(
                    1
                    for i in self._inflight.values()
                    if i.running_since is not None and not i.finishing and i.running_since < since
                )
        threads = self.concurrency - self._long_running
        if threads <= 0:
            return 0
        ahead = threads * self.prefetch_window / max(avg, 1e-6) - threads
        return max(0, min(room, int(ahead)))

    def _free_slots(self, prefetch: int = 0) -> int:
        """Leases to claim now: handler threads free plus `prefetch` jobs waiting, while
        at most as many results again wait for write-back (so claims overlap the
        flusher without holding unbounded leases: ≤ 2 × max(concurrency, max_prefetch))."""
        cap = self.concurrency + prefetch
        with self._lock:
            return min(
                cap - self._running - self._waiting,
                2 * cap - len(self._inflight),
            )

    def _claim_size(self) -> int:
        """How many to claim now (0: wait). With prefetch, a claim tops the buffer up
        once it is half empty, or at once when a thread would otherwise sit idle."""
        prefetch = self._prefetch()
        free = self._free_slots(prefetch)
        if free <= 0 or prefetch == 0 or self._waiting == 0:
            return free
        return free if free >= max(1, prefetch // 2) else 0

    def _release_unstarted(self, waited: float | None = None, reason: str = "") -> int:
        """Give back prefetched jobs no handler has taken (all, or those claimed more than
        `waited` seconds ago) in one fenced release: they keep their place in the queue
        and spend no retry, so another worker runs them now instead of after this
        worker's long jobs."""
        now = time.monotonic()
        with self._lock:
            items = [
                i
                for i in self._inflight.values()
                if i.waiting and (waited is None or now - i.started > waited)
            ]
            for item in items:  # a handler that pops one now skips it
                item.waiting = False
                item.finishing = True
                self._waiting -= 1
        if not items:
            return 0
        leases = [i.lease for i in items]
        reason = reason or f"prefetched, not started within {waited:g}s: released"
        try:
            ok = services.release(leases, reason, unstarted=True)
            log.info(
                "released %d prefetched job(s) not started: %s",
                len(ok),
                reason,
                extra={"worker_id": self.worker_id, "job_ids": [i.job_id for i in leases][:20]},
            )
        except (DatabaseError, InterfaceError) as exc:
            metrics.child(metrics.DB_ERRORS, "release").inc()
            log.warning(
                "could not release %d prefetched job(s) (%s); the reaper will",
                len(leases),
                exc,
                extra={"worker_id": self.worker_id},
            )
            connection.close()
        self._forget(leases)
        return len(items)

    # --- write-back in batches ----------------------------------------------------------

    def _flush_loop(self) -> None:
        outcomes = self._outcomes
        while not (self.halt.is_set() and outcomes.empty()):
            try:
                batch = [outcomes.get(timeout=0.1)]
            except queue_mod.Empty:
                continue
            # Natural group commit: everything that finished while the last write was
            # in flight goes into this one; an optional flush_interval waits for more.
            deadline = time.monotonic() + self.flush_interval
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(outcomes.get_nowait())
                except queue_mod.Empty:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        batch.append(outcomes.get(timeout=remaining))
                    except queue_mod.Empty:
                        break
            self._quiet.set()  # the write-back is under way: an idle dispatcher resumes
            try:
                self._write_back(batch)
            except Exception:  # never let one batch end write-backs for good
                log.exception(
                    "write-back of %d outcome(s) failed; the reaper will recover their jobs",
                    len(batch),
                    extra={"worker_id": self.worker_id},
                )
                self._forget([o.lease for o in batch])
        connection.close()

    def _write_back(self, batch: list[Outcome]) -> None:
        """Write a batch so that no statement holds two attempts of one job (results are
        matched to leases by job id; a job re-claimed by this worker while its stale
        attempt's result waited is written in a second round)."""
        while batch:
            seen: set[int] = set()
            now, later = [], []
            for o in batch:
                (later if o.lease.job_id in seen else now).append(o)
                seen.add(o.lease.job_id)
            self._write_back_unique(now)
            batch = later

    def _write_back_unique(self, batch: list[Outcome]) -> None:
        """One statement per kind for the whole batch, each retried until Postgres answers.

        A row PostgreSQL refuses (a data error, not a lost connection) is never retried
        with its batch: the batch is split until the row is alone, the rest is written,
        and that row's job fails by itself (see `_write_rows`).
        """
        with self._lock:
            batch = [o for o in batch if _key(o.lease) not in self._released]
        done = [(o.lease, o.result) for o in batch if o.kind == OutcomeKind.DONE]
        failed = [
            (o.lease, o.error, o.permanent, o.error_class, o.traceback, o.retry_after)
            for o in batch
            if o.kind == OutcomeKind.FAIL
        ]
        released = [o.lease for o in batch if o.kind == OutcomeKind.RELEASE]
        unwritten: set[int] = set()  # job ids given up on: left to the reaper, not stale

        def refused_result(item: tuple, exc: Exception) -> None:
            lease, _ = item
            error = storable(f"invalid result: PostgreSQL refused it ({_first_line(exc)})")
            failed.append((lease, error[:MAX_ERROR_CHARS], True, class_path(exc), None))
            log.warning("result refused by PostgreSQL: failing its job", extra=lease.log_fields())

        def refused_error(item: tuple, exc: Exception) -> tuple | None:
            lease, error, permanent, cls, tb, delay = item
            if cls is not None or tb is not None or not error.isascii():
                # Store the error alone, in plain ASCII: the detail was what was refused.
                ascii_error = error.encode("ascii", "backslashreplace").decode("ascii")
                return (lease, ascii_error[:MAX_ERROR_CHARS], permanent, None, None, delay)
            unwritten.add(lease.job_id)
            log.error(
                "PostgreSQL refused a failed attempt's write-back (%s); the reaper will "
                "recover the job",
                _first_line(exc),
                extra=lease.log_fields(),
            )
            return None

        ok_done = ok_fail = ok_rel = None
        ok_done = self._write_rows(services.complete, done, refused_result)
        if ok_done is not None:
            ok_fail = self._write_rows(services.fail, failed, refused_error)
        if ok_fail is not None:
            ok_rel = self._write_rows(services.release, released, None)
        if ok_done is None or ok_fail is None or ok_rel is None:
            log.error(
                "giving up write-back of %d outcome(s) at exit; the reaper will recover their jobs",
                len(batch),
                extra={
                    "worker_id": self.worker_id,
                    "job_ids": [o.lease.job_id for o in batch][:20],
                },
            )
            self._forget([o.lease for o in batch])
            return
        failing = {item[0].job_id for item in failed}
        stale = [lease for lease, _ in done if lease.job_id not in ok_done.keys() | failing]
        stale += [
            item[0]
            for item in failed
            if item[0].job_id not in ok_fail and item[0].job_id not in unwritten
        ]
        stale_ops = {lease.job_id: "complete" for lease, _ in done}
        stale_ops.update({item[0].job_id: "fail" for item in failed})
        for op in ("complete", "fail"):
            services.record_fence_rejections([s for s in stale if stale_ops[s.job_id] == op], op)
        self._count_finished(
            len(ok_done) + sum(1 for f in ok_fail.values() if f.status in TERMINAL)
        )
        # Workflow children these ends made due: pushed now, not at the next poll.
        durable.after_ends([*ok_done, *(i for i, f in ok_fail.items() if f.status in TERMINAL)])
        for o in batch:
            if o.kind == OutcomeKind.RELEASE and o.lease.job_id in ok_rel:
                log.info("released on shutdown", extra=o.lease.log_fields())
        self._forget([o.lease for o in batch])

    def _write_rows(
        self,
        write: Callable[[list], Any],
        items: list,
        refused: Callable[[Any, Exception], Any] | None,
    ) -> dict[int, Any] | None:
        """Run `write` over `items` until it lands; returns what landed, by job id.

        Connection and server trouble retries the same rows with backoff (None when
        the worker exits meanwhile). A data error is about some row, never about the
        batch: the rows are split in halves and written apart until the one PostgreSQL
        refuses is alone, and `refused(item, exc)` decides what happens to it (a
        replacement item to write instead, or None). Each statement commits on its
        own, so a retry never repeats rows that already landed.
        """
        landed: dict[int, Any] = {}
        pending = [items] if items else []
        backoff = Backoff(0.1, DB_BACKOFF_MAX)
        while pending:
            chunk = pending.pop()
            try:
                got = write(chunk)
            except _ROW_DATA_ERRORS as exc:
                if len(chunk) > 1:
                    half = len(chunk) // 2
                    pending += [chunk[half:], chunk[:half]]
                    continue
                lease = chunk[0][0] if isinstance(chunk[0], tuple) else chunk[0]
                metrics.WRITEBACK_REFUSED.labels(lease.queue, lease.task, write.__name__).inc()
                log.warning(
                    "write-back row refused by PostgreSQL: %s",
                    _first_line(exc),
                    extra=lease.log_fields(),
                )
                replacement = refused(chunk[0], exc) if refused is not None else None
                if replacement is not None:
                    pending.append([replacement])
                continue
            except (DatabaseError, InterfaceError) as exc:
                pending.append(chunk)
                metrics.child(metrics.DB_ERRORS, "write_back").inc()
                wait = backoff.next()
                log.warning(
                    "write-back failed, retrying in %.1fs: %s",
                    wait,
                    exc,
                    extra={"worker_id": self.worker_id},
                )
                connection.close()
                if self.halt.wait(wait) and wait >= DB_BACKOFF_MAX:
                    return None
                continue
            landed.update(got if isinstance(got, dict) else dict.fromkeys(got))
        return landed

    # --- heartbeats ------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        """Every lease_seconds/3, extend every held lease in one statement. In between,
        every progress interval, write only the leases whose handler reported progress
        not yet written (and not written within the interval), in the same fenced
        statement. Either way the answer carries pending cancel requests."""
        tick = min(self.heartbeat_interval, self.progress_interval)
        last_full = time.monotonic()
        while not self.halt.wait(tick):
            now = time.monotonic()
            full = now - last_full >= self.heartbeat_interval - tick / 2
            with self._lock:
                # A lease already lost is not offered again: one rejection per lost lease.
                held = [
                    i
                    for i in self._inflight.values()
                    if not i.finishing and not i.ctx.lost_authority
                ]
            reports = [self._due_progress(i, now) for i in held]
            if not full:
                held = [i for i, r in zip(held, reports, strict=True) if r is not None]
                reports = [r for r in reports if r is not None]
            if not held:
                if full:
                    last_full = now
                continue
            try:
                ok = services.heartbeat(
                    [i.lease for i in held],
                    [None if r is None else r[1] for r in reports],
                )
            except (DatabaseError, InterfaceError) as exc:
                metrics.child(metrics.DB_ERRORS, "heartbeat").inc()
                log.warning("heartbeat failed: %s", exc, extra={"worker_id": self.worker_id})
                connection.close()
                continue
            if full:
                last_full = now
            for item, report in zip(held, reports, strict=True):
                key = _key(item.lease)
                if key in ok:
                    if report is not None:
                        item.progress_saved = report[0]
                        item.progress_written_at = now
                    if key in ok.cancel_requested and not item.ctx._cancel_requested:
                        log.info("cancel requested: telling the handler to stop",
                                 extra=item.lease.log_fields())  # fmt: skip
                        item.ctx.request_cancel()
                # By (job id, lease_version): this worker's newer lease on the same job
                # must not vouch for an older attempt that was revoked or reaped.
                elif not item.finishing:
                    item.ctx.lost_authority = True
                    item.ctx.stop.set()
                    metrics.FENCE_REJECTIONS.labels(
                        item.lease.queue, item.lease.task, "heartbeat"
                    ).inc()
                    log.warning(
                        "lost authority over job (fenced off by a newer lease)",
                        extra=item.lease.log_fields(),
                    )
        connection.close()

    def _due_progress(self, item: InFlight, now: float) -> tuple[int, dict] | None:
        """The handler's latest progress report, if unwritten and due (rate-limited)."""
        report = item.ctx._progress
        if report is None or report[0] == item.progress_saved:
            return None
        if now - item.progress_written_at < self.progress_interval - 0.01:
            return None
        return report

    # --- shutdown ----------------------------------------------------------------------------

    def _drain(self) -> None:
        """On a stop request release prefetched jobs at once (after --max-jobs they are
        run: they were counted), wait up to `grace` for running jobs, then release the
        rest back to queued."""
        if self.stopping.is_set():
            self._release_unstarted(reason="prefetched, not started: released by worker shutdown")
        deadline = time.monotonic() + self.grace
        while self.inflight and time.monotonic() < deadline:
            self._slot_free.wait(0.05)
            self._slot_free.clear()
        with self._lock:
            leftover = [i for i in self._inflight.values() if not i.finishing]
            for item in leftover:
                item.ctx.stop.set()
                self._released.add(_key(item.lease))
        if leftover:
            try:
                ok = services.release([i.lease for i in leftover])
                log.info(
                    "released %d job(s) still running at the end of the grace period",
                    len(ok),
                    extra={"worker_id": self.worker_id},
                )
            except (DatabaseError, InterfaceError) as exc:
                log.warning(
                    "could not release jobs at shutdown (%s); the reaper will",
                    exc,
                    extra={"worker_id": self.worker_id},
                )
            self._forget([i.lease for i in leftover])
        # Outcomes already queued are written by the flusher before it exits.
        wait_until = time.monotonic() + 10
        while not self._outcomes.empty() and time.monotonic() < wait_until:
            time.sleep(0.01)
