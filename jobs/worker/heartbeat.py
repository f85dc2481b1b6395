"""One fenced statement extends every lease whose handler is alive and within its
timeout, writes due progress, and learns of cancel requests and lost leases."""

from __future__ import annotations

import time

from django.db import (
    DatabaseError,
    InterfaceError,
    connection,
)

from jobs import metrics, services, watchdog
from jobs.worker.attempts import (
    InFlight,
    _key,
    log,
)


class Heartbeats:
    """A room of `Worker` (jobs.worker): its methods run on the worker's own state."""

    def _heartbeat_loop(self) -> None:
        """Every lease_seconds/3, extend every held lease in one statement. In between,
        every progress interval, write only the leases whose handler reported progress
        not yet written (and not written within the interval), in the same fenced
        statement. Either way the answer carries pending cancel requests."""
        tick = min(self.heartbeat_interval, self.progress_interval)
        last_full = time.monotonic()
        grace = self.timeout_grace
        renewable = watchdog.renewable
        while not self.halt.wait(tick):
            now = time.monotonic()
            full = now - last_full >= self.heartbeat_interval - tick / 2
            with self._lock:
                # A lease already lost is not offered again: one rejection per lost lease.
                # Only live handlers within their timeout are vouched for (jobs.watchdog).
                held = [
                    i
                    for i in self._inflight.values()
                    if not i.finishing and not i.ctx.lost_authority and renewable(i, now, grace)
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
