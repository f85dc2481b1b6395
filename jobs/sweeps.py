"""One pass of the reaper's repairs (SPEC §5), in the order a job's troubles are found.

Every step works in bounded batches with FOR UPDATE SKIP LOCKED through a recovery
service (jobs.services.recovery), so any number of reapers can sweep side by side
without touching the same row twice. The signals (scheduled jobs that came due, lost
pushes) are a room of their own: they only speak to Redis, and only when a transport
is configured. Pacing the passes and stopping is the process's (jobs.reaper).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta

from jobs import metrics, partitions, selectors, services
from jobs.flow import retention
from jobs.lifecycle import Status
from jobs.transport import NullTransport, Transport, TransportError

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


class Resignals:
    """Pushes again what Redis should hold and does not: jobs that came due since the
    last pass (scheduled, backed off) and due jobs whose signal was lost."""

    def __init__(self, transport: Transport | NullTransport, lost_after: float, batch: int) -> None:
        self.transport = transport
        self.lost_after = lost_after
        self.batch = batch
        self._last_due_check = None

    def send(self, report: SweepReport) -> None:
        now = selectors.db_now()
        since = self._last_due_check
        if since is None:
            since = now - timedelta(seconds=self.lost_after)
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
        lost = selectors.waiting_too_long(empty, self.lost_after, self.batch * 10)
        if lost and self._push(lost, report):
            report.lost_signal = len(lost)
            metrics.RECOVERED.labels("lost_signal").inc(len(lost))

    def _push(self, pairs: list[tuple[int, str]], report: SweepReport) -> bool:
        try:
            services.push_now_ignoring_rollback(pairs)  # rows are committed; outside any txn
            return True
        except TransportError as exc:
            report.errors.append(str(exc))
            log.warning("reaper could not signal %d job(s): %s", len(pairs), exc)
            return False


class Sweep:
    """The repairs of one pass, each step drained batch by batch."""

    def __init__(
        self,
        lease: float,
        batch: int,
        gone_grace: float,
        crash_detection: bool,
        resignals: Resignals,
    ) -> None:
        self.lease = lease
        self.batch = batch
        self.gone_grace = gone_grace
        self.crash_detection = crash_detection
        self.resignals = resignals
        self._next_flow_prune = 0.0

    def reap_gone(self, report: SweepReport) -> None:
        """Jobs of workers whose session is gone (kill -9, OOM, host loss)."""
        gone = 0
        while True:
            reaped = services.reap_gone_owners(self.gone_grace, self.batch)
            gone += len(reaped)
            if len(reaped) < self.batch:
                break
        report.worker_gone += gone
        metrics.RECOVERED.labels("worker_gone").inc(gone)

    def run(self) -> SweepReport:
        started = time.monotonic()
        report = SweepReport()
        # 0. Jobs of workers whose session is gone.
        if self.crash_detection:
            self.reap_gone(report)
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
        if self.resignals.transport.enabled:
            self.resignals.send(report)
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
        return report
