"""Starting an attempt: its start recorded in PostgreSQL, so crash recovery charges only
attempts that started (D77), and a prefetched attempt no longer the worker's own is
never started (D78).

A job a claim hands straight to an idle handler thread is marked started by the claim.
A prefetched job is marked when a thread takes it, by one starter thread that writes
every start handed to it meanwhile in one fenced statement (natural group commit, like
the write-back). The thread waits for that mark before calling the handler only where
a crash charge would decide the job's end or a crash loop could hide: its last attempt,
or an attempt after one a crash ended with no start on record. Otherwise it calls the
handler at once and the start lands with the next statement (milliseconds), unless
the attempt ended first (its outcome then says more than its start).
What the heartbeats said is checked first: a revoked, reaped or cancelled attempt is
dropped without running.
"""

from __future__ import annotations

import enum
import logging
import queue as queue_mod
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import DatabaseError, InterfaceError, connection

from jobs import metrics, services
from jobs.runtime import Backoff
from jobs.services import Lease
from jobs.tasks import JobContext

log = logging.getLogger(__name__)

MAX_BATCH = 1000
BACKOFF_MAX = 10.0


class Verdict(enum.StrEnum):
    """What a thread does with a job it took from the prefetch buffer."""

    RUN = "run"  # call the handler
    REVOKED = "revoked"  # the lease is no longer this worker's: forget it
    CANCELLED = "cancelled"  # a cancel request is pending: end it cancelled, unrun
    STOPPED = "stopped"  # the worker exits before the mark landed: the reaper requeues it


def must_wait(lease: Lease) -> bool:
    """Whether the handler waits for the start mark: on the last attempt a crash charge
    fails the job, and after a crash that found no start on record (a handler that
    kills its process at once) the next crash must be charged."""
    return lease.retry_count >= lease.max_retries or lease.rerun


@dataclass(eq=False)
class _Request:
    lease: Lease
    ctx: JobContext
    waits: bool = True
    answered: threading.Event = field(default_factory=threading.Event)
    verdict: Verdict = Verdict.STOPPED


_Key = tuple[int, int]


class PrefetchLook:
    """Every `every` seconds, the prefetched leases are read (not written): a revoke or a
    cancel is known in memory before a thread takes the job (D78)."""

    def __init__(
        self, worker_id: str, prefetched: Callable[[], list[tuple[Lease, JobContext]]], every: float
    ) -> None:
        self.worker_id = worker_id
        self.every = every
        self._prefetched = prefetched
        self._looked = time.monotonic()

    def when_due(self) -> None:
        if time.monotonic() - self._looked >= self.every:
            self.look()

    def look(self) -> None:
        self._looked = time.monotonic()
        waiting = self._prefetched()
        if not waiting:
            return
        try:
            held = services.still_held([lease for lease, _ in waiting])
        except (DatabaseError, InterfaceError) as exc:
            metrics.child(metrics.DB_ERRORS, "start").inc()
            log.warning("could not look at prefetched leases: %s", exc,
                        extra={"worker_id": self.worker_id})  # fmt: skip
            connection.close()
            return
        for lease, ctx in waiting:
            key = (lease.job_id, lease.lease_version)
            if key not in held:
                ctx.lost_authority = True
                ctx.stop.set()
            elif key in held.cancel_requested:
                ctx.request_cancel()


class MarkWriter:
    """The starter thread: the starts handed to it gathered into batches of at most
    MAX_BATCH, each written by `write` (one fenced statement) as soon as the previous
    one is done (natural group commit), and the prefetched leases looked at in between
    (PrefetchLook). What it has not written when the worker halts is answered STOPPED."""

    def __init__(
        self,
        worker_id: str,
        halt: threading.Event,
        look: PrefetchLook,
        write: Callable[[list[_Request | _Key]], None],
    ) -> None:
        self.worker_id = worker_id
        self.halt = halt
        self.look = look
        self.requests: queue_mod.SimpleQueue[_Request | _Key] = queue_mod.SimpleQueue()
        self._write = write
        self._thread = threading.Thread(target=self._loop, name="starter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _loop(self) -> None:
        requests = self.requests
        while not self.halt.is_set():
            self.look.when_due()
            try:
                batch = [requests.get(timeout=min(0.1, self.look.every))]
            except queue_mod.Empty:
                continue
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(requests.get_nowait())
                except queue_mod.Empty:
                    break
            self._write(batch)
        while True:  # threads still waiting: their jobs never started
            try:
                request = requests.get_nowait()
            except queue_mod.Empty:
                break
            if isinstance(request, _Request):
                request.answered.set()
        connection.close()

    def mark(self, batch: list[_Request]) -> services.Held | None:
        """The starts written, retried until PostgreSQL answers; None when the worker
        halts first (every request answered STOPPED: the reaper requeues them)."""
        backoff = Backoff(0.1, BACKOFF_MAX)
        while True:
            try:
                return services.mark_started([r.lease for r in batch])
            except (DatabaseError, InterfaceError) as exc:
                metrics.child(metrics.DB_ERRORS, "start").inc()
                wait = backoff.next()
                log.warning(
                    "could not mark %d attempt(s) started, retrying in %.1fs: %s",
                    len(batch),
                    wait,
                    exc,
                    extra={"worker_id": self.worker_id},
                )
                connection.close()
                if self.halt.wait(wait):
                    for r in batch:
                        r.answered.set()  # STOPPED: the reaper requeues them
                    return None


class Starter:
    """Admission: whether a thread that took a job calls its handler, and what the start
    marks the writer thread (MarkWriter) wrote say to each attempt."""

    def __init__(
        self,
        worker_id: str,
        halt: threading.Event,
        prefetched: Callable[[], list[tuple[Lease, JobContext]]] = list,
        look_every: float = 0.5,
    ) -> None:
        look = PrefetchLook(worker_id, prefetched, look_every)
        self._writer = MarkWriter(worker_id, halt, look, self._write)
        # Started without waiting, start not yet written: dropped when the attempt ends.
        self._unmarked: dict[_Key, tuple[Lease, JobContext]] = {}
        # Marks on their way to PostgreSQL, and those of them whose attempt ended
        # meanwhile: a fast attempt retried before its mark lands is not "lost".
        self._writing: set[_Key] = set()
        self._ended_while_writing: set[_Key] = set()

    def start(self) -> None:
        self._writer.start()

    def join(self, timeout: float) -> None:
        self._writer.join(timeout)

    def admit(self, lease: Lease, ctx: JobContext, marked: bool = False) -> Verdict:
        """Whether to call the handler of a job a thread took; records its start unless
        its claim did (`marked`)."""
        if ctx.lost_authority:
            verdict = Verdict.REVOKED
        elif ctx._cancel_requested:
            verdict = Verdict.CANCELLED
        elif marked:
            return Verdict.RUN
        elif must_wait(lease):
            request = _Request(lease, ctx)
            self._writer.requests.put(request)
            request.answered.wait()
            verdict = request.verdict
        else:
            key = (lease.job_id, lease.lease_version)
            self._unmarked[key] = (lease, ctx)
            self._writer.requests.put(key)
            return Verdict.RUN
        if verdict in (Verdict.REVOKED, Verdict.CANCELLED):
            metrics.ATTEMPTS_DROPPED.labels(lease.queue, verdict.value).inc()
            log.info("%s while prefetched: not started", verdict.value, extra=lease.log_fields())
        return verdict

    def ended(self, lease: Lease) -> None:
        """The attempt ended (its outcome is on its way): its start need not be written."""
        key = (lease.job_id, lease.lease_version)
        if self._unmarked.pop(key, None) is None and key in self._writing:
            self._ended_while_writing.add(key)

    def _write(self, requests: list[_Request | _Key]) -> None:
        """A batch the writer gathered: the waiting threads' requests, and the starts of
        attempts still running (those ended meanwhile need no mark)."""
        batch = []
        for r in requests:
            if isinstance(r, _Request):
                batch.append(r)
            else:
                self._writing.add(r)  # before the pop: ended() may run at any moment
                if (started := self._unmarked.pop(r, None)) is not None:
                    batch.append(_Request(*started, waits=False))
                else:
                    self._writing.discard(r)
        if not batch:
            return
        held = self._writer.mark(batch)
        if held is not None:
            self._answer(batch, held)

    def _answer(self, batch: list[_Request], held: services.Held) -> None:
        """Each request's verdict from what the mark found; a handler already running
        (not waiting) is told to stop or to cancel, as a heartbeat would."""
        for r in batch:
            key = (r.lease.job_id, r.lease.lease_version)
            if key not in held:
                r.verdict = Verdict.REVOKED
            elif key in held.cancel_requested:
                r.verdict = Verdict.CANCELLED
            else:
                r.verdict = Verdict.RUN
            ended = key in self._ended_while_writing
            if (
                not r.waits
                and not ended
                and r.verdict == Verdict.REVOKED
                and not r.ctx.lost_authority
            ):
                # Its handler runs already: told to stop, as a heartbeat would.
                r.ctx.lost_authority = True
                r.ctx.stop.set()
                log.warning("lost authority over job at its start", extra=r.lease.log_fields())
            elif not r.waits and r.verdict == Verdict.CANCELLED:
                r.ctx.request_cancel()
            self._writing.discard(key)
            self._ended_while_writing.discard(key)
            r.answered.set()
