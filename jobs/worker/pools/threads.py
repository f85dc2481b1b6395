"""The default pool: `--concurrency` handler threads of the worker process."""

from __future__ import annotations

from jobs import watchdog
from jobs.worker.attempts import InFlight


class ThreadPool:
    """Handler threads fed from the worker's heap. A stuck thread cannot be killed: the
    watchdog abandons it and a new thread takes its slot (D84)."""

    kind = "threads"

    def __init__(self, worker) -> None:
        self.worker = worker
        self.capacity = worker.concurrency

    def start(self) -> None:
        for _ in range(self.capacity):
            self.worker._spawn_handler()

    def replaces(self, item: InFlight) -> bool:
        return True

    def write_off(self, item: InFlight, verdict: watchdog.Verdict) -> None:
        self.worker._spawn_handler()  # the slot is served again at once
        if verdict == watchdog.Verdict.TIMEOUT:
            self.worker._abandoned_thread(item.lease)

    def stop(self, cold: bool) -> None:
        """Handler threads end on the worker's exit tokens; stuck ones die with it."""

    def alive(self) -> int:
        """Live handler threads, at most `capacity` (abandoned ones still running are
        not told apart: they end with the worker's restart)."""
        return min(self.capacity, sum(1 for t in self.worker._handlers if t.is_alive()))
