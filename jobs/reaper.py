"""The reaper: repairs what crashes, lost messages and stale workers leave behind (SPEC §5).

Every sweep works in bounded batches with FOR UPDATE SKIP LOCKED, so any
number of reapers can run side by side without touching the same row twice.
Between sweeps, every JOBS_PRESENCE_SECONDS, it looks for workers whose
PostgreSQL session is gone (jobs.presence) and requeues their jobs at once:
a kill -9 is recovered in seconds, not a lease.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from django.db import DatabaseError, InterfaceError, close_old_connections, connection

from jobs import metrics, partitions, selectors, services
from jobs.conf import settings
from jobs.flow import retention
from jobs.lifecycle import Status
from jobs.runtime import Backoff, StopRequests
from jobs.transport import TransportError, get_transport

log = logging.getLogger(__name__)
FLOW_PRUNE_EVERY = 60.0  # seconds between the reaper's passes over jobs.flow's rows


@dataclass
class SweepReport:
    worker_gone: int = 0
    lease_requeued: int = 0
    lease_failed: int = 0
    repaired: int = 0
    over_budget: int = 0
    came_due: int = 0
    lost_signal: int = 0
    moved: int = 0  # not counted in total(): a move repairs nothing
    flow_pruned: int = 0  # nor this: bookkeeping rows of jobs.flow (D361)
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def total(self) -> int:
        return (
            self.worker_gone
            + self.lease_requeued
            + self.lease_failed
            + self.repaired
            + self.over_budget
            + self.came_due
            + self.lost_signal
        )


class Reaper:
    """Sweeps every `interval` seconds until stopped; `sweep()` runs one pass."""

    def __init__(
        self,
        interval: float | None = None,
        lease: float | None = None,
        batch: int = 500,
        lost_signal_after: float | None = None,
        crash_detection: bool | None = None,
    ) -> None:
        self.interval = interval if interval is not None else settings.JOBS_REAPER_INTERVAL
        self.lease = lease if lease is not None else settings.JOBS_LEASE_SECONDS
        self.batch = batch
        self.lost_signal_after = (
            lost_signal_after
            if lost_signal_after is not None
            else settings.JOBS_LOST_SIGNAL_SECONDS
        )
        self.crash_detection = (
            settings.JOBS_SESSION_CRASH_DETECTION if crash_detection is None else crash_detection
        )
        self.presence_seconds = settings.JOBS_PRESENCE_SECONDS
        # Three beats: a worker whose connection was killed notices at its next beat
        # (≤ 1) and is back at once, with room for a loaded machine.
        self.gone_grace = 3 * self.presence_seconds
        self.transport = get_transport()
        self.stop = threading.Event()
        self._last_due_check = None
        self._stops = StopRequests(self.stop.set)
        self.last_sweep_at = 0.0  # unix time the last sweep finished (a gauge)
        self._next_flow_prune = 0.0

    def request_stop(self) -> None:
        """First request: finish the current sweep and exit. Second: raise ColdStop now
        (a sweep cut short rolls back; the next reaper repeats it)."""
        self._stops.request()

    def install_signal_handlers(self) -> None:
        self._stops.install()

    def run(self) -> None:
        backoff = Backoff(self.interval, 60.0)
        log.info("reaper started: lease %.1fs, interval %.1fs", self.lease, self.interval)
        try:
            self._run(backoff)
        finally:
            connection.close()
        log.info("reaper stopped")

    def _run(self, backoff: Backoff) -> None:
        while not self.stop.is_set():
            close_old_connections()
            try:
                report = self.sweep()
                backoff.reset()
                if report.total():
                    log.info("sweep repaired %d job(s)", report.total(), extra=vars(report))
                wait = max(0.0, self.interval - report.seconds)
            except (DatabaseError, InterfaceError) as exc:
                metrics.DB_ERRORS.labels(op="sweep").inc()
                log.warning("sweep failed, postgres unavailable: %s", exc)
                connection.close()
                wait = backoff.next()
            self._wait_checking_workers(wait)

    def _wait_checking_workers(self, wait: float) -> None:
        """Wait for the next sweep, looking for gone workers every presence period."""
        deadline = time.monotonic() + wait
        while not self.stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if not self.crash_detection:
                self.stop.wait(remaining)
                continue
            if self.stop.wait(min(remaining, self.presence_seconds)):
                return
            try:
                report = SweepReport()
                self._reap_gone(report)
                if report.worker_gone:
                    log.info("requeued %d job(s) of gone workers", report.worker_gone)
            except (DatabaseError, InterfaceError) as exc:
                metrics.DB_ERRORS.labels(op="sweep").inc()
                log.warning("gone-worker check failed, postgres unavailable: %s", exc)
                connection.close()

    def _reap_gone(self, report: SweepReport) -> None:
        gone = 0
        while True:
            reaped = services.reap_gone_owners(self.gone_grace, self.batch)
            gone += len(reaped)
            if len(reaped) < self.batch:
                break
        report.worker_gone += gone
        metrics.RECOVERED.labels("worker_gone").inc(gone)

    def sweep(self) -> SweepReport:
        started = time.monotonic()
        report = SweepReport()
        # 0. Jobs of workers whose session is gone (kill -9, OOM, host loss).
        if self.crash_detection:
            self._reap_gone(report)
        # 1. Expired leases: requeue with a retry spent, or fail when the budget is gone.
        while True:
            reaped = services.reap_expired(self.lease, self.batch)
            for f in reaped.values():
                if f.status == Status.QUEUED:
                    report.lease_requeued += 1
                else:
                    report.lease_failed += 1
            if len(reaped) < self.batch:
                break
        metrics.RECOVERED.labels("lease").inc(report.lease_requeued + report.lease_failed)
        # 2. Rows whose push failed after submission.
        while True:
            repaired = services.repair_enqueue_failed(self.batch)
            report.repaired += len(repaired)
            if len(repaired) < self.batch:
                break
        metrics.RECOVERED.labels(Status.ENQUEUE_FAILED.value).inc(report.repaired)
        # 3. Rows over budget that never got to run again.
        report.over_budget = len(services.fail_over_budget(self.batch))
        metrics.RECOVERED.labels("over_budget").inc(report.over_budget)
        # 4 and 5. Signals: scheduled or backed-off jobs that came due, and lost signals.
        if self.transport.enabled:
            self._signal(report)
        # 6. Registry rows of workers that are gone or silent, once they own nothing.
        services.forget_workers(self.gone_grace, 2 * self.lease)
        # 7. Partitions ahead, and finished jobs out of the hot partition (D163).
        report.moved = partitions.maintain()
        # 8. Per-key bookkeeping no live job needs (D361), once a minute at most.
        if time.monotonic() >= self._next_flow_prune:
            report.flow_pruned = retention.prune(batch=self.batch).total
            self._next_flow_prune = time.monotonic() + FLOW_PRUNE_EVERY
        report.seconds = time.monotonic() - started
        metrics.REAPER_SWEEPS.inc()
        metrics.REAPER_SWEEP_DURATION.observe(report.seconds)
        self.last_sweep_at = time.time()
        return report

    def _push(self, pairs: list[tuple[int, str]], report: SweepReport) -> bool:
        try:
            services.push_now_ignoring_rollback(pairs)  # rows are committed; outside any txn
            return True
        except TransportError as exc:
            report.errors.append(str(exc))
            log.warning("reaper could not signal %d job(s): %s", len(pairs), exc)
            return False

    def _signal(self, report: SweepReport) -> None:
        now = selectors.db_now()
        since = self._last_due_check
        if since is None:
            from datetime import timedelta

            since = now - timedelta(seconds=self.lost_signal_after)
        due = selectors.came_due(since, now, self.batch * 10)
        if due and self._push(due, report):
            report.came_due = len(due)
            metrics.RECOVERED.labels("scheduled").inc(len(due))
        self._last_due_check = now
        # Lost signals matter only where a queue's list is empty: a non-empty list
        # means workers are behind and will get there; an empty one with due jobs
        # waiting means their signals are gone.
        queues = selectors.queued_queues()
        if not queues:
            return
        try:
            lengths = self.transport.lengths(queues)
        except TransportError as exc:
            report.errors.append(str(exc))
            return
        empty = [q for q in queues if lengths.get(q, 0) == 0]
        if not empty:
            return
        lost = selectors.waiting_too_long(empty, self.lost_signal_after, self.batch * 10)
        if lost and self._push(lost, report):
            report.lost_signal = len(lost)
            metrics.RECOVERED.labels("lost_signal").inc(len(lost))
