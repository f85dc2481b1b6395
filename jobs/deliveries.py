"""Webhook deliveries on slots of their own: a second worker in the runworker process.

A receiver that answers slowly must not take the threads of the jobs whose events it
receives (issue 27). When a worker serves the `webhooks` queue besides others (the
default `default,webhooks`, or `*`), `runworker` runs that queue on a separate
`Worker` with JOBS_WEBHOOK_CONCURRENCY threads (`--webhook-concurrency`), its own
claims, heartbeats, write-back and registration; the main worker no longer claims
deliveries, `*` included. Both stop together: the first signal warm-stops both,
the second cold-stops both. A worker that serves `webhooks` alone is left as it is:
all its slots are delivery slots already.
"""

from __future__ import annotations

import logging
import signal
import threading

from jobs.dispatch import QueueSpec, parse_queues
from jobs.events import endpoints
from jobs.events.signing import WEBHOOK_QUEUE
from jobs.runtime import ColdStop
from jobs.worker import Worker

log = logging.getLogger(__name__)


def split(spec: QueueSpec) -> tuple[QueueSpec, bool]:
    """(what the main worker serves, whether deliveries get their own worker)."""
    if not spec.serves(WEBHOOK_QUEUE) or (not spec.serves_all and len(spec.weights) == 1):
        return spec, False
    return spec.without(WEBHOOK_QUEUE), True


def delivery_worker(main: Worker, concurrency: int) -> Worker:
    """The deliveries' worker, shaped like `main` (burst, grace, polling), claiming only
    for free threads: a prefetched delivery would wait, claimed, behind slow receivers'
    (its attempt, in the history, longer than JOBS_WEBHOOK_TIMEOUT)."""
    return Worker(
        parse_queues(WEBHOOK_QUEUE),
        concurrency,
        burst=main.burst,
        grace=main.grace,
        poll_interval=main.poll_interval,
        lease_seconds=main.lease_seconds,
        flush_interval=main.flush_interval,
        prefetch=0,
    )


class Pair:
    """Runs `main` on the calling (main) thread and `deliveries` on a thread of its own."""

    def __init__(self, main: Worker, deliveries: Worker) -> None:
        self.main = main
        self.deliveries = deliveries
        self._signals = 0
        self._thread = threading.Thread(target=self._run_deliveries, name="deliveries", daemon=True)

    def install_signal_handlers(self, signals=(signal.SIGTERM, signal.SIGINT)) -> None:
        for sig in signals:
            signal.signal(sig, lambda *_: self.request_stop())

    def request_stop(self) -> None:
        """First call: warm stop of both. Second: cold stop of both; ColdStop is raised
        here (the main thread), as a single worker does."""
        self._signals += 1
        try:
            self.deliveries.request_stop()
        except ColdStop:
            pass  # its run loop sees halt set and leaves; this thread leaves by main's
        self.main.request_stop()

    def _run_deliveries(self) -> None:
        try:
            self.deliveries.run()
        except Exception:
            log.exception("the webhook delivery worker failed",
                          extra={"worker_id": self.deliveries.worker_id})  # fmt: skip
        finally:
            if not self.main.stopping.is_set() and not self.main.burst:
                # Deliveries stopped alone (failed): without them the process must not
                # go on looking healthy; it stops, and its supervisor starts it again.
                log.error("webhook deliveries stopped; stopping the worker",
                          extra={"worker_id": self.main.worker_id})  # fmt: skip
                self.main.request_stop()

    def run(self) -> int:
        """Jobs finished by both; returns once both workers have stopped."""
        self._thread.start()
        try:
            finished = self.main.run()
        finally:
            if self._signals == 0:
                self.deliveries.request_stop()  # main ended by itself: burst or --max-jobs
        self._thread.join()
        endpoints.SLOTS.close()
        return finished + self.deliveries.finished
