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

Rooms: `Worker` (here) discovers, claims and hands jobs out; each other concern is a
module of its own, mixed into it: `execution` (a handler thread runs one attempt and
settles it), `prefetch`, `heartbeat`, `watch` (the watchdog's loop; its rules are
jobs.watchdog), `writeback` (the flusher) and `shutdown`; `attempts` holds what they
share (an attempt in flight, its outcome, the result check). `pools` says where
handlers run: threads of this process (the default) or pre-forked children.

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

import heapq
import itertools
import logging
import queue as queue_mod
import threading
import time

from django.db import (
    DatabaseError,
    InterfaceError,
    close_old_connections,
    connection,
)

from jobs import durable, metrics, selectors, tasks, watchdog
from jobs.conf import settings
from jobs.dispatch import QueueSpec, parse_queues
from jobs.errors import PerKeyRateLimit
from jobs.presence import Presence
from jobs.queuecontrol import Gate
from jobs.queues import BUILTIN as BUILTIN_QUEUES
from jobs.runtime import Backoff, StopRequests
from jobs.services import Lease
from jobs.starts import Starter
from jobs.tasks import JobContext
from jobs.transport import TransportError, get_transport
from jobs.worker import pools
from jobs.worker.attempts import (
    DB_BACKOFF_MAX,
    HEALTH_CHECK_EVERY,
    IDLE_HANDOFF_WAIT,
    MAX_PREFETCH,
    PREFETCH_WINDOW_FRACTION,
    REDIS_BACKOFF_MAX,
    STALE_CHECK_EVERY,
    InFlight,
    InvalidResult,
    Outcome,
    OutcomeKind,
    _key,
    check_result,
    log,
    new_worker_id,
)
from jobs.worker.execution import Execution
from jobs.worker.heartbeat import Heartbeats
from jobs.worker.prefetch import Prefetch
from jobs.worker.shutdown import Shutdown
from jobs.worker.watch import Watch
from jobs.worker.writeback import WriteBack

__all__ = [
    "IDLE_HANDOFF_WAIT", "MAX_PREFETCH", "InFlight", "InvalidResult", "Outcome", "OutcomeKind",
    "Worker", "check_result", "new_worker_id",
]  # fmt: skip


class Worker(Execution, Prefetch, WriteBack, Heartbeats, Watch, Shutdown):
    """Runs jobs from the given queues until told to stop.

    First `request_stop()`: stop claiming, let running jobs finish within
    `grace` seconds, release the rest (fenced, lease bumped), exit. Second:
    exit at once; leases still held are recovered by the reaper.
    """

    def __init__(
        self,
        queues: list[str] | QueueSpec | None = None,
        concurrency: int | None = None,
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
        pool: str = "threads",
        max_tasks_per_child: int = 0,
        max_memory_per_child: int = 0,
    ) -> None:
        if not isinstance(queues, QueueSpec):
            queues = parse_queues(",".join(queues or ["default"]))
        self.spec = queues
        self.queues = list(queues.names)
        if concurrency is None:
            concurrency = pools.DEFAULT_CONCURRENCY.get(pool, 1)  # pools.make refuses a bad one
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
        self._serves_all = self.spec.serves_all  # the spec is the worker's for its life
        self._several_queues = len(own) > 1 or self._serves_all
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
        # Claimed jobs wait in a heap under `_lock`: first those their claim marked
        # started (they are what the idle threads take, D211), then priority DESC, then
        # claim order, so a job claimed later with a higher priority starts before
        # prefetched lower ones; `_ready` carries one token per entry to wake a handler
        # thread (None: exit).
        self._heap: list[tuple[bool, int, int, InFlight]] = []
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
        self.timeout_grace = watchdog.grace_seconds()
        self.max_abandoned = max(1, settings.JOBS_MAX_ABANDONED_THREADS)
        self.abandoned = 0  # handler threads left to a stuck handler
        # Too many abandoned threads: the worker stops gracefully and runworker starts
        # it again in a fresh process (the stuck threads cannot be killed otherwise).
        self.restart_requested = False
        self._handlers: list[threading.Thread] = []
        # Where handlers run: threads of this process or pre-forked children (jobs.worker.pools).
        self.pool = pools.make(pool, self, max_tasks_per_child, max_memory_per_child)

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

    def run(self) -> int:
        """Run until stopped (or, with burst/max_jobs, until done); returns jobs finished."""
        log.info(
            "worker started",
            extra={
                "worker_id": self.worker_id,
                "queues": self.queues,
                "concurrency": self.concurrency,
                "pool": self.pool.kind,
            },
        )
        tasks.load()
        # Registered (and, with session crash detection, locked) before the first claim.
        presence = Presence(self.worker_id, self.queues, self.concurrency)
        presence.start()
        self.pool.start()
        flusher = threading.Thread(target=self._flush_loop, name="flusher", daemon=True)
        beater = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        watcher = threading.Thread(target=self._watch_loop, name="watchdog", daemon=True)
        for thread in (flusher, beater, watcher):
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
            for _ in range(self.concurrency):  # one per serving thread (abandoned ones exit)
                self._ready.put(None)
            self.pool.stop(self._stops.cold)
            # A cold stop does not wait for a write-back in flight: the reaper has it.
            flusher.join(timeout=1 if self._stops.cold else 30)
            beater.join(timeout=1 if self._stops.cold else 5)
            self.starter.join(timeout=1)
            if not self._stops.cold:  # each closes its session on its way out (D228)
                until = time.monotonic() + 2  # abandoned ones are stuck in a handler
                for thread in self._handlers:
                    thread.join(timeout=max(0.0, until - time.monotonic()))
            presence.stop()
            connection.close()
        log.info("worker stopped", extra={"worker_id": self.worker_id, "finished": self.finished})
        return self.finished

    def _queues_found(self) -> list[str]:
        """The queues with work, read at most once a poll interval (for a worker serving
        `*`; none otherwise)."""
        if self._serves_all and time.monotonic() - self._found_at >= self.poll_interval:
            self._found = selectors.queued_queues()
            self._found_at = time.monotonic()
        return self._found

    def _discover(self, free: int, start: int | None = None) -> list[Lease] | None:
        """Claim up to `free` jobs. None means "nothing, loop again at once".

        A pop of k ids from queue q claims the k best due rows of q (not those ids):
        Redis says when to look, PostgreSQL says what runs first. An id that finds
        no row (claimed by someone else already) counts as a duplicate delivery.
        """
        try:
            # The gate is asked once before the pop: the order, the held-back work, the wake.
            leases, order, wake = self.gate.first_look(
                self.worker_id, self.spec, self._queues_found(), free, start=start
            )
            if leases:
                return leases
            if not order:  # serving `*` and no queue has work, or every queue paused or limited
                if wake is not None:  # a slot this worker frees may end a cap's wait sooner
                    self._slot_free.wait(wake)
                    return None
                self.stopping.wait(self.poll_interval if not self.burst else 0)
                return []
            if self.transport.enabled and time.monotonic() >= self._redis_down_until:
                try:
                    timeout = 0 if self._pg_had_work else self.poll_interval
                    if wake is not None:  # a blocked queue's slot may come sooner
                        timeout = min(wake, timeout)
                    queue, ids = self.transport.pop(order, timeout, free)
                    if self._redis_backoff.backing_off:
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
                    if self._db_backoff.backing_off:
                        self._db_backoff.reset()
                    if leases:
                        return leases
                    return None
            leases = self.gate.claim_next(self.worker_id, order, free, start=start)
            if self._db_backoff.backing_off:
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
                # Marked first: the claim marked its best rows in its own order (turns
                # in a fair queue), the threads must run those, not the heap's best.
                heapq.heappush(self._heap, (not item.marked, -item.lease.priority, next(seq), item))
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
