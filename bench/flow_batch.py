"""`python -m bench.flow_batch [--jobs N] [--workers W]` (or `make flow-batch`).

One batch of N no-op jobs (the issue's 100,000 by default) with an on_complete callback,
run by W workers on a scratch database and a private redis-server: prints the database
time of the batch's creation and the rows it wrote per table, how long the workers took,
how many callback jobs were made (exactly one is the rule) and the delay from the last
job's end to the callback's start and end (both on the database's clock). It reports;
it never asserts a timing.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TABLES = ("jobs_job", "jobs_batch", "jobs_batchfailure", "jobs_sequence", "jobs_sequencewait")

_COUNTERS_SQL = f"""
SELECT relname, n_tup_ins, n_tup_upd, coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0)
FROM pg_stat_xact_user_tables
WHERE relname IN ({", ".join(f"'{t}'" for t in TABLES)}) OR relname ~ '^jobs_job_(hot|p[0-9]+)$'"""


def _counters(cur) -> dict[str, tuple[int, int, int]]:
    cur.execute(_COUNTERS_SQL)
    found: dict[str, tuple[int, int, int]] = {}
    for name, *rest in cur.fetchall():  # a partitioned table counts per partition
        key = "jobs_job" if name.startswith("jobs_job") and name not in TABLES else name
        old = found.get(key, (0, 0, 0))
        found[key] = tuple(a + b for a, b in zip(old, rest, strict=True))
    return found


def measured(op: Callable[[], Any]) -> tuple[Any, dict[str, tuple[int, ...]], float]:
    """Run `op` in a transaction: (its value, rows (inserted, updated, read) per table,
    database seconds from before its first statement to after its last)."""
    from django.db import connection, transaction

    with transaction.atomic(), connection.cursor() as cur:
        before = _counters(cur)
        cur.execute("SELECT clock_timestamp()")
        (start,) = cur.fetchone()
        value = op()
        cur.execute("SELECT extract(epoch FROM clock_timestamp() - %s)", [start])
        (seconds,) = cur.fetchone()
        after = _counters(cur)
    zero = (0, 0, 0)
    delta = {t: tuple(a - b for a, b in zip(after.get(t, zero), before.get(t, zero), strict=True))
             for t in TABLES}  # fmt: skip
    return value, delta, float(seconds)


_AFTER_SQL = """
SELECT (SELECT max(finished_at) FROM jobs_job WHERE batch_id = %(b)s),
       c.started_at, c.finished_at, c.status, cardinality(b.callback_job_ids)
FROM jobs_batch b LEFT JOIN jobs_job c ON c.id = b.callback_job_ids[1]
WHERE b.id = %(b)s"""


def run(jobs: int, workers: int, processes_of: Callable[[], Any]) -> dict[str, Any]:
    """Create the batch, start the workers, wait for the callback to end."""
    from django.db import connection

    from jobs.flow import batches

    items = [{"task": "echo", "payload": {}} for _ in range(jobs)]
    callback = {"on_complete": batches.task_callback("echo", {"report": "done"})}
    (batch_id, _), rows, create_s = measured(lambda: batches.create(items, callback))
    procs = processes_of()
    started = time.monotonic()
    for _ in range(workers):
        procs.worker("--concurrency", "8")
    procs.reaper()
    try:
        while True:
            with connection.cursor() as cur:
                cur.execute(_AFTER_SQL, {"b": batch_id})
                last, cb_start, cb_end, cb_status, made = cur.fetchone()
            if cb_status in ("done", "failed"):
                break
            time.sleep(0.5)
        elapsed = time.monotonic() - started
    finally:
        procs.stop_all()
    return {
        "batch": batch_id, "create_s": create_s, "rows": rows, "run_s": elapsed,
        "callbacks": made, "callback_status": cb_status,
        "start_delay": (cb_start - last).total_seconds() if cb_start else None,
        "end_delay": (cb_end - last).total_seconds(),
    }  # fmt: skip


def overhead(jobs: int, rounds: int) -> dict[str, float]:
    """What the flow triggers cost jobs that use neither sequences nor batches: database
    seconds to claim and complete `jobs` plain jobs (write-backs of 100), with the
    triggers and without them (dropped, then installed again). Median of `rounds`."""
    import statistics

    from django.db import connection

    from jobs import services
    from jobs.migrations import _triggers as frozen

    def one() -> float:
        made = services.submit_many([services.NewJob("echo", {}) for _ in range(jobs)])
        ids = [m.job_id for m in made]

        def work() -> None:
            for start in range(0, len(ids), 100):
                leases = services.claim_ids("bench-overhead", ids[start : start + 100])
                services.complete([(lease, None) for lease in leases])

        return measured(work)[2]

    out: dict[str, list[float]] = {"with triggers": [], "without": []}
    for _ in range(rounds):
        for label, sql in (("without", frozen.DROP_FLOW_TRIGGERS_0027),
                           ("with triggers", frozen.FLOW_TRIGGERS_0027)):  # fmt: skip
            with connection.cursor() as cur:
                cur.execute(sql)
            out[label].append(one())
    return {label: statistics.median(v) for label, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.flow_batch", description=__doc__)
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--overhead", type=int, default=0, metavar="N",
                   help="Instead: N plain jobs claimed and completed with and without the "
                   "flow triggers (their cost to jobs that use neither).")  # fmt: skip
    args = p.parse_args(argv)

    from bench.env import processes, scratch_database, setup_django
    from harness import RedisServer

    db = scratch_database().create()
    redis = RedisServer().start()
    logdir = Path(tempfile.mkdtemp(prefix="flow-batch-"))
    try:
        setup_django(db.url(), redis.url, JOBS_MAX_QUEUE_DEPTH=str(args.jobs * 2))
        if args.overhead:
            for label, seconds in overhead(args.overhead, 3).items():
                print(f"{args.overhead:,} plain jobs claimed and completed, {label}: "
                      f"{seconds:.3f} s database time (median of 3)")  # fmt: skip
            return
        out = run(args.jobs, args.workers, lambda: processes(db.url(), redis.url, logdir))
        created = out["rows"]
        print(f"batch of {args.jobs:,} no-op jobs, {args.workers} workers:")
        print(f"  create        {out['create_s']:8.3f} s database time; rows inserted: "
              f"jobs {created['jobs_job'][0]:,}, batch {created['jobs_batch'][0]}")  # fmt: skip
        print(f"  run           {out['run_s']:8.1f} s until the callback ended")
        print(f"  callbacks     {out['callbacks']} made, {out['callback_status']}")
        # A no-op callback can end before its start mark is written (D246): no start then.
        start = out["start_delay"]
        start = "not marked" if start is None else f"{start:.3f} s"
        print(f"  last end -> callback start {start}, "
              f"end {out['end_delay']:.3f} s (database clock)")  # fmt: skip
    finally:
        from django.db import connections

        connections.close_all()
        redis.stop()
        db.drop()


if __name__ == "__main__":
    main()
