"""Fillfactor from measurement (`--scenario fillfactor`): the same churn on the hot job
table at fillfactor 100, 90 and 70, side by side.

The churn is the workers' own writes through `jobs.services`: submit a batch, claim it
in slices, heartbeat every held lease a few times, complete. For each setting it reports
the share of updates that were HOT (`n_tup_hot_upd / n_tup_upd`), the heartbeats' own
HOT share, dead tuples, and heap and index size. Autovacuum runs as configured (the
per-table settings of migration 0004), as it would in production.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg

from bench.measure import hot_table, sql
from bench.scenarios import Context, reset, scenario

FILLFACTORS = (100, 90, 70)
BATCH = 500
CLAIM_SLICE = 50
HEARTBEATS = 3


def table_stats(db_url: str, table: str) -> dict[str, Any]:
    """Counters as the statistics collector has them, after this backend's are flushed."""
    sql("SELECT pg_stat_force_next_flush()")
    time.sleep(0.5)
    with psycopg.connect(db_url) as c:
        row = c.execute(
            """SELECT n_tup_upd, n_tup_hot_upd, n_dead_tup, n_live_tup, autovacuum_count,
                      pg_relation_size(relid), pg_indexes_size(relid)
               FROM pg_stat_user_tables WHERE relid = %s::regclass""",
            [table],
        ).fetchone()
    keys = ("updates", "hot_updates", "dead_tuples", "live_tuples", "autovacuums")
    out = dict(zip(keys, row[:5], strict=True))
    out["heap_mb"] = round(row[5] / 2**20, 2)
    out["indexes_mb"] = round(row[6] / 2**20, 2)
    return out


def churn(jobs: int, table: str, vacuum_every: int | None) -> float:
    """submit → claim → heartbeat × HEARTBEATS → complete for `jobs` jobs, with a plain
    VACUUM of `table` every `vacuum_every` jobs when given; seconds."""
    from django.db import transaction

    from jobs import services

    started = time.perf_counter()
    for n in range(1, max(1, jobs // BATCH) + 1):
        with transaction.atomic():
            services.submit_many([services.NewJob("echo", {"n": i}) for i in range(BATCH)])
        held = []
        for _ in range(BATCH // CLAIM_SLICE):
            held.extend(services.claim_next("bench-ff", ["default"], CLAIM_SLICE))
        for _ in range(HEARTBEATS):
            for i in range(0, len(held), CLAIM_SLICE):
                services.heartbeat(held[i : i + CLAIM_SLICE])
        services.complete([(lease, {"ok": True}) for lease in held])
        if vacuum_every and n * BATCH % vacuum_every == 0:
            sql(f"VACUUM {table}")
    return time.perf_counter() - started


def heartbeat_hot_share(db_url: str, table: str) -> float:
    """The HOT share of heartbeats alone, on the table as the churn left it."""
    from django.db import transaction

    from jobs import services

    with transaction.atomic():
        services.submit_many([services.NewJob("echo", {}) for _ in range(BATCH)])
    held = services.claim_next("bench-ff", ["default"], BATCH)
    before = table_stats(db_url, table)
    for _ in range(10):
        for i in range(0, len(held), CLAIM_SLICE):
            services.heartbeat(held[i : i + CLAIM_SLICE])
    after = table_stats(db_url, table)
    services.complete([(lease, None) for lease in held])
    updates = after["updates"] - before["updates"]
    return (after["hot_updates"] - before["hot_updates"]) / max(1, updates)


@scenario("fillfactor")
def fillfactor(ctx: Context) -> Iterator[dict]:
    jobs = ctx.args.jobs or (2000 if ctx.quick else 50_000)
    table = hot_table()
    url = ctx.db.url()
    # Autovacuum's stand-in where the server runs without it: a VACUUM every 2 % of the
    # churn (0004's threshold), beside the run with none at all.
    autovacuum = sql("SHOW autovacuum")[0][0] == "on"
    for ff, vacuum_every in [(ff, v) for v in (None, jobs // 50) for ff in FILLFACTORS]:
        if vacuum_every and autovacuum:
            continue
        reset(ctx)
        sql(f"ALTER TABLE {table} SET (fillfactor = {ff})")
        sql("SELECT pg_stat_reset_single_table_counters(%s::regclass)", [table])
        seconds = churn(jobs, table, vacuum_every)
        stats = table_stats(url, table)
        stats["hot_share"] = round(stats["hot_updates"] / max(1, stats["updates"]), 3)
        stats["heartbeat_hot_share"] = round(heartbeat_hot_share(url, table), 3)
        stats["seconds"] = round(seconds, 1)
        vacuum = f"VACUUM every {vacuum_every:,} jobs" if vacuum_every else "no VACUUM"
        if not vacuum_every and autovacuum:
            vacuum = "autovacuum"
        yield {
            "figure": f"{table} fillfactor {ff}, {vacuum}: HOT share of updates after "
            f"{jobs:,} jobs' churn",
            "value": float(stats["hot_share"]),
            "unit": "share",
            "summary": (
                f"heartbeats HOT {stats['heartbeat_hot_share']:.1%}; "
                f"{stats['updates']:,} updates, {stats['dead_tuples']:,} dead tuples, "
                f"heap {stats['heap_mb']} MB, indexes {stats['indexes_mb']} MB, "
                f"{stats['autovacuums']} autovacuums, churn {seconds:.1f}s"
            ),
            "details": {"fillfactor": ff, "table": table, "jobs": jobs, "vacuum": vacuum, **stats},
        }
