"""Where attempts run: a pool of handler threads or of pre-forked child processes.

Both implement `Pool`, so the worker claims, prefetches, heartbeats and writes back
the same way whichever runs its handlers: a slot (a handler thread, or a parent
thread driving one child) takes an `InFlight` off the worker's heap, runs it and
settles its outcome through the worker's fenced write-back. The watchdog asks the
pool to end an attempt that outlived its timeout: the thread pool abandons the
thread and replaces it, the process pool kills the child (D125-D129).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from jobs import watchdog
    from jobs.worker.attempts import InFlight

POOLS = ("threads", "processes")
# Attempts run at once when --concurrency is not given (D395): threads mostly wait (a
# durable step's flushed commit, a handler's I/O), so eight; a child is a process of
# its own per attempt, so four, as before.
DEFAULT_CONCURRENCY = {"threads": 8, "processes": 4}


class Pool(Protocol):
    kind: str
    capacity: int  # attempts run at once (--concurrency)

    def start(self) -> None: ...

    def replaces(self, item: InFlight) -> bool:
        """Whether ending `item` by the watchdog gives its slot to a new thread (so the
        old one leaves the pool when its handler returns)."""
        ...

    def write_off(self, item: InFlight, verdict: watchdog.Verdict) -> None:
        """End the handler of an attempt the watchdog wrote off (abandon or kill)."""
        ...

    def stop(self, cold: bool) -> None: ...

    def alive(self) -> int:
        """Slots able to run an attempt now."""
        ...


def make(kind: str, worker, max_tasks_per_child: int = 0, max_memory_mb: int = 0) -> Pool:
    if kind == "threads":
        from jobs.worker.pools.threads import ThreadPool

        return ThreadPool(worker)
    if kind == "processes":
        from jobs.worker.pools.processes import ProcessPool

        return ProcessPool(worker, max_tasks_per_child, max_memory_mb)
    raise ValueError(f"pool must be one of {', '.join(POOLS)}, not {kind!r}")
