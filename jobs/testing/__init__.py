"""Run queued jobs inside a test, synchronously (docs/testing.md).

`run_jobs()` is a worker, not a stand-in for one: a `Worker` built as runworker builds
it claims through the queue controls, admits, runs and settles each attempt with the
handler threads' own methods, and writes it back with the flusher's fenced batch write,
all in the calling thread and on its connection. So it sees a `TestCase`'s uncommitted
rows, its writes roll back with the test, and it opens no connection a
`TransactionTestCase`'s teardown would trip over (D227).
"""

from __future__ import annotations

import queue as queue_mod
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import connection

if TYPE_CHECKING:
    from jobs.models import Job
    from jobs.services import Lease
    from jobs.worker import Worker

__all__ = ["MAX_JOBS", "BrokenTestTransaction", "Ran", "run_jobs"]

MAX_JOBS = 1000  # a job that enqueues itself again must not loop a test forever
TICK = 0.05  # seconds between looks for attempts past their timeout


class BrokenTestTransaction(RuntimeError):
    """A handler's failed SQL statement aborted the test's transaction."""


@dataclass(frozen=True)
class Ran:
    """One attempt `run_jobs()` ran, and its job's row right after its write-back."""

    job: Job
    attempt: int  # 1 for the first attempt, 2 for the first retry, ...

    @property
    def status(self) -> str:
        """done, failed, or queued again (a retry, or released)."""
        return self.job.status

    @property
    def result(self) -> Any:
        return self.job.result

    @property
    def error(self) -> str:
        return self.job.error

    def __repr__(self) -> str:
        return f"<Ran job {self.job.pk} {self.job.task} attempt {self.attempt}: {self.status}>"


def run_jobs(
    queue: str | None = None, until_empty: bool = True, *, max_jobs: int = MAX_JOBS
) -> list[Ran]:
    """Run the due jobs of `queue` (None: every queue but the webhook deliveries') in
    this thread and return the attempts in the order they ran.

    `until_empty=False` runs what is due now, once; True claims again until nothing is
    due, so the jobs those enqueue and the retries that come due (JOBS_RETRY_BACKOFF_BASE
    = 0 makes them due at once) run too, up to `max_jobs` attempts.
    """
    from jobs import deliveries, dispatch
    from jobs.worker import Worker

    spec, _ = deliveries.split(dispatch.parse_queues(queue or "*"))
    # One thread (the caller's), no prefetch beyond what one claim takes, queues with
    # work looked up at every claim (poll_interval 0).
    worker = Worker(spec, 1, burst=True, poll_interval=0, prefetch=0)
    ran: list[Ran] = []
    timeouts = _SoftTimeouts(worker)
    timeouts.start()
    try:
        while len(ran) < max_jobs:
            leases = _claim(worker, max_jobs - len(ran))
            if not leases:
                break
            # Every lease of the claim is marked started by it: the starter thread that
            # would mark the others is not running (D227).
            worker._start(leases, marked=len(leases))
            for lease in _run_claimed(worker):
                row = _row_after(lease)
                ran.append(Ran(row, lease.retry_count + 1))
            if not until_empty:
                break
    finally:
        timeouts.stop()
    return ran


def _claim(worker: Worker, limit: int) -> list[Lease]:
    """What the worker's dispatcher claims from PostgreSQL (Redis hints are not read)."""
    order = worker.gate.polling_order(worker.spec, worker._queues_found())
    if not order:
        return []
    return worker.gate.claim_next(worker.worker_id, order, limit, start=limit)


def _run_claimed(worker: Worker) -> list[Lease]:
    """Take the claimed attempts off the worker's heap one by one, in its order, as a
    handler thread does, and write each back before the next starts."""
    taken = []
    while True:
        try:
            token = worker._ready.get_nowait()
        except queue_mod.Empty:
            return taken
        if token is None or (item := worker._take()) is None:
            continue
        worker._run_taken(item)
        _check_transaction()
        worker._write_back(_drain(worker._outcomes))
        taken.append(item.lease)


def _drain(outcomes: queue_mod.SimpleQueue) -> list:
    batch = []
    while True:
        try:
            batch.append(outcomes.get_nowait())
        except queue_mod.Empty:
            return batch


def _check_transaction() -> None:
    """A worker's statements run in autocommit; in a TestCase they share the test's
    transaction, which a handler's failed statement leaves aborted."""
    from psycopg.pq import TransactionStatus

    raw = connection.connection
    if raw is not None and raw.info.transaction_status == TransactionStatus.INERROR:
        raise BrokenTestTransaction(
            "a handler's SQL statement failed and aborted the test's transaction, so its "
            "attempt cannot be written back: run this test in a TransactionTestCase, or "
            "wrap the handler's statement in transaction.atomic()"
        )


def _row_after(lease: Lease) -> Job:
    from jobs import selectors

    return selectors.jobs_in_bulk([lease.job_id])[lease.job_id]


class _SoftTimeouts:
    """The watchdog's soft stop for the attempt running in the caller's thread: at its
    timeout the handler is told to stop (ctx.stop, ctx.timed_out), as the worker's
    watchdog tells it. The hard end cannot be had: the caller's thread is not abandoned,
    so a handler that ignores the stop runs to its end (docs/testing.md)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="run_jobs-timeouts", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def _loop(self) -> None:
        from jobs import watchdog

        worker = self.worker
        while not self.done.wait(TICK):
            with worker._lock:
                running = [
                    i for i in worker._inflight.values() if i.thread is not None and not i.finishing
                ]
            for item, _ in watchdog.examine(running, time.monotonic(), worker.timeout_grace):
                if not item.ctx.timed_out:
                    item.ctx.time_out()
