"""How many jobs to claim ahead of the handler threads (D67), and giving back
those no thread took in time."""

from __future__ import annotations

import time

from django.db import (
    DatabaseError,
    InterfaceError,
    connection,
)

from jobs import metrics, services
from jobs.worker.attempts import (
    RUN_TIME_DOWN,
    RUN_TIME_UP,
    log,
)


class Prefetch:
    """A room of `Worker` (jobs.worker): its methods run on the worker's own state."""

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
