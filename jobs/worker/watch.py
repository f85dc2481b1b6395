"""The watchdog's loop (the rules are in jobs.watchdog): soft stops, hard ends
and lost handlers, each slot replaced at once."""

from __future__ import annotations

import time

from jobs import metrics, watchdog
from jobs.errors import class_path
from jobs.worker.attempts import (
    WATCHDOG_TICK,
    InFlight,
    Outcome,
    OutcomeKind,
    _key,
    log,
)


class Watch:
    """A room of `Worker` (jobs.worker): its methods run on the worker's own state."""

    def _watch_loop(self) -> None:
        """Four times a second: tell handlers past their timeout to stop, end attempts
        past timeout + grace or whose handler thread is gone (jobs.watchdog)."""
        while not self.halt.wait(WATCHDOG_TICK):
            self._watch_once(time.monotonic())

    def _watch_once(self, now: float) -> None:
        with self._lock:
            running = [
                i
                for i in self._inflight.values()
                if i.thread is not None and not i.finishing and not i.abandoned
            ]
        for item, verdict in watchdog.examine(running, now, self.timeout_grace):
            if verdict == watchdog.Verdict.SOFT:
                log.warning(
                    "attempt reached its %gs timeout: telling the handler to stop",
                    item.limit,
                    extra=item.lease.log_fields(),
                )
                item.ctx.time_out()
            else:
                self._write_off(item, verdict)

    def _write_off(self, item: InFlight, verdict: watchdog.Verdict) -> None:
        """End an attempt its handler will not end: failed (retried per budget) through
        the fenced write-back, which bumps the lease, so nothing the handler does later
        lands; the pool frees the slot (a new handler thread, or its child killed)."""
        with self._lock:
            if item.finishing or item.abandoned or _key(item.lease) not in self._inflight:
                return  # its handler settled it meanwhile
            item.replaced = self.pool.replaces(item)
            item.abandoned = item.finishing = True
            self._running -= 1
        lease = item.lease
        self.starter.ended(lease)
        item.ctx.stop.set()
        if verdict == watchdog.Verdict.TIMEOUT:
            error = watchdog.timeout_error(item.limit or 0, self.timeout_grace)
            exc_class = watchdog.AttemptTimeout
        else:
            error = watchdog.lost_error(f"handler thread {item.thread.name}")
            exc_class = watchdog.HandlerLost
        metrics.ATTEMPTS_ENDED_BY_WATCHDOG.labels(lease.queue, lease.task, verdict.value).inc()
        log.error("attempt ended by the watchdog: %s", error, extra=lease.log_fields())
        self._outcomes.put(
            Outcome(lease, OutcomeKind.FAIL, error=error, error_class=class_path(exc_class()))
        )
        self.pool.write_off(item, verdict)  # abandoned (threads) or killed (processes)
        self._slot_free.set()

    def _abandoned_thread(self, lease) -> None:
        """A thread left to a stuck handler: counted; too many restart the worker (D84)."""
        metrics.ABANDONED_THREADS.labels(lease.queue, lease.task).inc()
        self.abandoned += 1
        if self.abandoned >= self.max_abandoned and not self.restart_requested:
            log.error(
                "%d handler threads abandoned to stuck handlers: restarting the worker",
                self.abandoned,
                extra={"worker_id": self.worker_id},
            )
            self.restart_requested = True
            self._warm_stop()
