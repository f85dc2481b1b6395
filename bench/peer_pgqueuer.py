"""pgqueuer's in-process enqueue, the peer figure beside `http-single` (issue 41).

pgqueuer is not a dependency of the project: `pip install pgqueuer` into the environment
that runs the bench, or the scenario reports NOT MEASURED. Its schema goes into the
bench's scratch database (its own tables, `pgqueuer*`); 8 threads, each with its own
autocommit psycopg connection and `SyncQueries(SyncPsycopgDriver(conn))`, enqueue one
job per call for the measured seconds: one durable INSERT per job, as pgqueuer's
`enqueue` makes it, with no HTTP and no server process in between.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

from bench.measure import fmt_pcts, percentiles

THREADS = 8


def _install(url: str) -> None:
    import psycopg
    from pgqueuer.db import PsycopgDriver
    from pgqueuer.queries import Queries

    async def install() -> None:
        conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
        try:
            queries = Queries(PsycopgDriver(conn))
            if not await queries.has_table("pgqueuer"):
                await queries.install()
        finally:
            await conn.close()

    asyncio.run(install())


def _enqueue_for(url: str, seconds: float, start: threading.Event, out: list) -> None:
    import psycopg
    from pgqueuer.db import SyncPsycopgDriver
    from pgqueuer.queries import SyncQueries

    with psycopg.connect(url, autocommit=True) as conn:
        queries = SyncQueries(SyncPsycopgDriver(conn))
        queries.enqueue("bench_noop", b'{"n": 1}')  # warm: the connection and the plan
        start.wait()
        latencies = []
        end = time.perf_counter() + seconds
        while (t0 := time.perf_counter()) < end:
            queries.enqueue("bench_noop", b'{"n": 1}')
            latencies.append((time.perf_counter() - t0) * 1000)
        out.append(latencies)


def enqueue(ctx: Any) -> Iterator[dict]:
    name = "peer-pgqueuer-enqueue"
    figure = f"pgqueuer SyncQueries.enqueue in process, {THREADS} threads"
    try:
        import pgqueuer
    except ImportError:
        note = "NOT MEASURED: pgqueuer is not installed (pip install pgqueuer)"
        yield {"scenario": name, "figure": figure, "value": None, "unit": "jobs/s", "note": note}
        return
    url = ctx.db.url()
    _install(url)
    seconds = 2.0 if ctx.quick else 10.0
    start, out = threading.Event(), []
    threads = [
        threading.Thread(target=_enqueue_for, args=(url, seconds, start, out))
        for _ in range(THREADS)
    ]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every thread connected and warmed
    t0 = time.perf_counter()
    start.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    latencies = sorted(x for per in out for x in per)
    yield {
        "scenario": name,
        "code": f"pgqueuer {getattr(pgqueuer, '__version__', '')}".strip(),
        "figure": figure,
        "value": len(latencies) / elapsed,
        "unit": "jobs/s",
        "summary": f"{len(latencies)} jobs in {elapsed:.2f}s; enqueue latency "
        f"{fmt_pcts(percentiles(latencies))}",
        "details": {"jobs": len(latencies), "seconds": elapsed, "threads": THREADS},
    }
