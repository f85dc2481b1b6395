"""`python -m bench.pool_start`: what starting one process-pool child costs by start method
(D127). A child counts as started when its first message reaches the parent; the parent is
a Django process with every task loaded, as a worker is. Reports; asserts nothing."""

from __future__ import annotations

import multiprocessing
import os
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "jobservice.settings")

import django

django.setup()

from jobs import tasks  # noqa: E402

tasks.load()

import jobs.worker.pools.child  # noqa: E402, F401  (what a child runs, loaded as in a worker)


def _child(conn) -> None:
    conn.send(os.getpid())
    conn.recv()


def measure(method: str, n: int) -> tuple[float, float]:
    """(median, max) milliseconds from Process.start() to the child's first message."""
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["bench.pool_start"])  # the server sets Django up once
    times = []
    for i in range(n + 1):
        started = time.perf_counter()
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=_child, args=(theirs,))
        process.start()
        ours.recv()
        if i:  # the first forkserver start also starts the server
            times.append(time.perf_counter() - started)
        ours.send(0)
        process.join()
    times.sort()
    return times[len(times) // 2] * 1000, times[-1] * 1000


if __name__ == "__main__":
    print(f"load average {os.getloadavg()[0]:.2f}")
    for method, n in (("fork", 20), ("forkserver", 20), ("spawn", 5)):
        median, worst = measure(method, n)
        print(f"{method:<10} median {median:.1f} ms, max {worst:.1f} ms ({n} starts)")
