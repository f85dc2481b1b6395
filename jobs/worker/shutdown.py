"""Stopping: warm (finish within the grace, release the rest), then cold."""

from __future__ import annotations

import time

from django.db import (
    DatabaseError,
    InterfaceError,
)

from jobs import services
from jobs.worker.attempts import (
    _key,
    log,
)


class Shutdown:
    """A room of `Worker` (jobs.worker): its methods run on the worker's own state."""

    def request_stop(self) -> None:
        """First call: warm stop. Second: raises ColdStop (from a signal handler, in the
        main thread, so run()'s `finally` still closes connections and unregisters)."""
        self._stops.request()

    def install_signal_handlers(self) -> None:
        self._stops.install()

    def _warm_stop(self) -> None:
        log.info("worker stopping: finishing in-flight jobs", extra={"worker_id": self.worker_id})
        self.stopping.set()

    def _cold_stop(self) -> None:
        log.warning(
            "worker exiting now; held leases will be reaped", extra={"worker_id": self.worker_id}
        )
        self.stopping.set()
        self.halt.set()

    def _drain(self) -> None:
        """On a stop request release prefetched jobs at once (after --max-jobs they are
        run: they were counted), wait up to `grace` for running jobs, then release the
        rest back to queued."""
        if self.stopping.is_set():
            self._release_unstarted(reason="prefetched, not started: released by worker shutdown")
        deadline = time.monotonic() + self.grace
        while self.inflight and time.monotonic() < deadline:
            self._slot_free.wait(0.05)
            self._slot_free.clear()
        with self._lock:
            leftover = [i for i in self._inflight.values() if not i.finishing]
            for item in leftover:
                item.ctx.stop.set()
                self._released.add(_key(item.lease))
        if leftover:
            try:
                ok = services.release([i.lease for i in leftover])
                log.info(
                    "released %d job(s) still running at the end of the grace period",
                    len(ok),
                    extra={"worker_id": self.worker_id},
                )
            except (DatabaseError, InterfaceError) as exc:
                log.warning(
                    "could not release jobs at shutdown (%s); the reaper will",
                    exc,
                    extra={"worker_id": self.worker_id},
                )
            self._forget([i.lease for i in leftover])
        # Outcomes already queued are written by the flusher before it exits.
        wait_until = time.monotonic() + 10
        while not self._outcomes.empty() and time.monotonic() < wait_until:
            time.sleep(0.01)
