"""The scheduler loop every runreaper hosts on a thread of its own (docs/schedules.md).

No leader: each replica fires whatever is due, and the scheduler_runs row each slot
inserts first decides which one makes the job. It looks again when the earliest
schedule comes due, and at least every JOBS_SCHEDULER_POLL_SECONDS (an edit made
elsewhere is seen that soon).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from django.db import DatabaseError, InterfaceError, close_old_connections, connection

from jobs import metrics
from jobs.conf import settings
from jobs.runtime import Backoff
from jobs.schedules import firing

log = logging.getLogger(__name__)

# A tick fires at most this many schedules before it lets the loop breathe.
TICK_SCHEDULES = 100


@dataclass
class TickReport:
    schedules: int = 0
    jobs: int = 0
    skipped: int = 0
    until_next: float | None = None


class Scheduler:
    """`tick()` fires every due slot once; `start(stop)` runs ticks on a thread until stop."""

    def __init__(self, poll: float | None = None) -> None:
        self.poll = poll if poll is not None else settings.JOBS_SCHEDULER_POLL_SECONDS
        self.last_tick_at = 0.0  # unix time of the last tick that reached the database
        self.overdue = 0.0  # how late the most overdue enabled schedule was at that tick

    def tick(self) -> TickReport:
        report = TickReport()
        for _ in range(TICK_SCHEDULES):
            fired = firing.fire_next_due()
            if fired is None:
                break
            report.schedules += 1
            report.jobs += sum(1 for f in fired if f.job_id is not None)
            report.skipped += sum(1 for f in fired if f.job_id is None)
        report.until_next = firing.seconds_until_next_due()
        self.overdue = max(0.0, -(report.until_next or 0.0))
        self.last_tick_at = time.time()
        return report

    def run(self, stop: threading.Event) -> None:
        backoff = Backoff(self.poll, 30.0)
        try:
            while not stop.is_set():
                close_old_connections()
                try:
                    report = self.tick()
                    backoff.reset()
                    until = report.until_next if report.until_next is not None else self.poll
                    wait = min(self.poll, max(0.01, until))
                except (DatabaseError, InterfaceError) as exc:
                    metrics.DB_ERRORS.labels(op="schedule").inc()
                    log.warning("scheduler tick failed, postgres unavailable: %s", exc)
                    connection.close()
                    wait = backoff.next()
                except Exception:  # a bug must not end the thread: the reaper lives on
                    log.exception("scheduler tick failed")
                    wait = backoff.next()
                stop.wait(wait)
        finally:
            connection.close()

    def start(self, stop: threading.Event) -> threading.Thread:
        """Run on a daemon thread (its own database connection) until `stop` is set."""
        thread = threading.Thread(target=self.run, args=(stop,), name="scheduler", daemon=True)
        thread.start()
        return thread
