"""Starting an attempt: marked started in PostgreSQL before its handler is called (D77).

A job a claim hands straight to an idle handler thread is marked started by the claim
itself. A prefetched job is marked when a thread takes it: the thread hands it to one
starter thread, which marks everything handed to it meanwhile in one fenced statement
(natural group commit, like the write-back), so a busy worker marks many starts per
statement and an idle one none. The answer says whether the lease is still the
worker's own: a revoked or reaped attempt is dropped without running, a cancelled one
ends `cancelled` without running (D78).
"""

from __future__ import annotations

import enum
import logging
import queue as queue_mod
import threading
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

    RUN = "run"  # marked started: call the handler
    REVOKED = "revoked"  # the lease is no longer this worker's: forget it
    CANCELLED = "cancelled"  # a cancel request is pending: end it cancelled, unrun
    STOPPED = "stopped"  # the worker exits before the mark landed: the reaper requeues it


@dataclass(eq=False)
class _Request:
    lease: Lease
    answered: threading.Event = field(default_factory=threading.Event)
    verdict: Verdict = Verdict.STOPPED


class Starter:
    """The starter thread and the verdicts it hands back to handler threads."""

    def __init__(self, worker_id: str, halt: threading.Event) -> None:
        self.worker_id = worker_id
        self.halt = halt
        self._requests: queue_mod.SimpleQueue[_Request] = queue_mod.SimpleQueue()
        self.statements = 0  # marks written: batches, not jobs
        self._thread = threading.Thread(target=self._loop, name="starter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def admit(self, lease: Lease, ctx: JobContext, marked: bool = False) -> Verdict:
        """Mark `lease` started (blocking until the mark landed) unless its claim did
        (`marked`) or what the heartbeats told this worker says it must not run."""
        if ctx.lost_authority:
            verdict = Verdict.REVOKED
        elif ctx._cancel_requested:
            verdict = Verdict.CANCELLED
        elif marked:
            return Verdict.RUN
        else:
            request = _Request(lease)
            self._requests.put(request)
            request.answered.wait()
            verdict = request.verdict
        if verdict in (Verdict.REVOKED, Verdict.CANCELLED):
            metrics.ATTEMPTS_DROPPED.labels(lease.queue, verdict.value).inc()
            log.info("%s while prefetched: not started", verdict.value, extra=lease.log_fields())
        return verdict

    def _loop(self) -> None:
        requests = self._requests
        while not self.halt.is_set():
            try:
                batch = [requests.get(timeout=0.1)]
            except queue_mod.Empty:
                continue
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(requests.get_nowait())
                except queue_mod.Empty:
                    break
            self._mark(batch)
        # Threads still waiting are told to stop: their jobs were never started.
        while True:
            try:
                requests.get_nowait().answered.set()
            except queue_mod.Empty:
                break
        connection.close()

    def _mark(self, batch: list[_Request]) -> None:
        """One fenced statement for the batch, retried until PostgreSQL answers: a
        handler is never called before its start is on record."""
        backoff = Backoff(0.1, BACKOFF_MAX)
        while True:
            try:
                held = services.mark_started([r.lease for r in batch])
                break
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
                        r.answered.set()  # STOPPED
                    return
        self.statements += 1
        for r in batch:
            key = (r.lease.job_id, r.lease.lease_version)
            if key not in held:
                r.verdict = Verdict.REVOKED
            elif key in held.cancel_requested:
                r.verdict = Verdict.CANCELLED
            else:
                r.verdict = Verdict.RUN
            r.answered.set()
