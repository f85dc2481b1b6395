"""The reaper: repairs what crashes, lost messages and stale workers leave behind (SPEC §5).

This is the process: it paces the passes (jobs.sweeps holds what one pass repairs),
backs off while PostgreSQL is away, and stops on request. Between sweeps, every
JOBS_PRESENCE_SECONDS, it looks for workers whose PostgreSQL session is gone
(jobs.presence) and requeues their jobs at once: a kill -9 is recovered in seconds,
not a lease.
"""

from __future__ import annotations

import logging
import threading
import time

from django.db import DatabaseError, InterfaceError, close_old_connections, connection

from jobs import metrics
from jobs.conf import settings
from jobs.runtime import Backoff, StopRequests
from jobs.sweeps import Resignals, Sweep, SweepReport
from jobs.transport import get_transport

log = logging.getLogger(__name__)


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
        lost_signal_after = (
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
        gone_grace = 3 * self.presence_seconds
        resignals = Resignals(get_transport(), lost_signal_after, batch)
        self._sweep = Sweep(self.lease, batch, gone_grace, self.crash_detection, resignals)
        self.stop = threading.Event()
        self._stops = StopRequests(self.stop.set)
        self.last_sweep_at = 0.0  # unix time the last sweep finished (a gauge)

    def request_stop(self) -> None:
        """First request: finish the current sweep and exit. Second: raise ColdStop now
        (a sweep cut short rolls back; the next reaper repeats it)."""
        self._stops.request()

    def install_signal_handlers(self) -> None:
        self._stops.install()

    def sweep(self) -> SweepReport:
        report = self._sweep.run()
        self.last_sweep_at = time.time()
        return report

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
                self._sweep.reap_gone(report)
                if report.worker_gone:
                    log.info("requeued %d job(s) of gone workers", report.worker_gone)
            except (DatabaseError, InterfaceError) as exc:
                metrics.DB_ERRORS.labels(op="sweep").inc()
                log.warning("gone-worker check failed, postgres unavailable: %s", exc)
                connection.close()
