"""The table-growth benchmark (`--scenario table-growth`, `make table-growth`): today's
layout beside the partitioned one, each filled to the same N jobs, one after the other.

Each layout runs in a child process (`python -m bench.table_growth --layout ...`) on a
scratch database of its own, `jobservice_tablegrowth_<checkout>_<layout>`, created,
measured and dropped before the next layout starts (50 M jobs of both do not fit the disk
together):

- today's layout is the tree as it was before the first jobs migration after 0020
  (exported with `git archive`, so its own code runs on its own schema), migrated to 0020;
- the partitioned layout is this tree, migrated to its latest migration.

The fill is SQL (`generate_series`), not the API: N jobs over 8 weeks of created_at, the
oldest first, each finished one with five history rows (queued, processing, retried,
processing, done or failed: seq 1..5 without gaps, lease and retry counts that match the
job), then a live backlog inserted with the triggers on. The lifecycle triggers are off
for the bulk fill only, and only in a database whose name starts with the scratch prefix
(`session_replication_role = replica`, this session's writes alone).

It reports figures; it never asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any

import psycopg

from bench.measure import fmt_pcts, percentiles, released_together
from bench.scenarios import scenario
from harness import DEFAULT_ADMIN_URL, ROOT, ScratchDatabase
from harness.scratch import checkout_tag

SCRATCH_PREFIX = "jobservice_tablegrowth_"
WEEKS = 8
CHUNK = 500_000
DEFAULT_JOBS = 50_000_000
# A day of production at the full size: 50 M jobs over 8 weeks is ~893 k jobs a day
# (~10 jobs/s). The churn runs N / (7 * WEEKS) jobs, a day at this fill's own scale.
DAYS = 7 * WEEKS
CHURN_BATCH = 500


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def backlog(jobs: int) -> int:
    """Queued jobs at fill time: 100 k at full size, never more than 2 % of the fill."""
    return max(100, min(100_000, jobs // 50))


# --- the fill --------------------------------------------------------------------------------

_FILL_JOBS = """
INSERT INTO jobs_job (id, task, payload, queue, priority, status, result, error, run_at,
    max_retries, retry_count, lease_version, created_at, updated_at, finished_at, updated_by,
    due_at, started_at, event_seq{period_col})
SELECT g, 'echo', jsonb_build_object('n', g), 'default', 0,
       CASE WHEN g %% 20 = 0 THEN 'failed' ELSE 'done' END,
       CASE WHEN g %% 20 = 0 THEN NULL ELSE jsonb_build_object('n', g) END,
       CASE WHEN g %% 20 = 0 THEN 'bench: permanent error' END,
       t, 3, 1, 3, t, t + interval '4 seconds', t + interval '4 seconds', 'worker:bench',
       t, t + interval '3 seconds', 5{period}
FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g,
     LATERAL (SELECT %(start)s::timestamptz + %(span)s::interval * (g::float8 / %(n)s)) AS x(t)
"""

# The five transitions of a job retried once; the same arithmetic as the job's row.
_FILL_HISTORY = """
INSERT INTO jobs_jobevent (job_id, kind, at, from_status, to_status, actor, lease_version,
    retry_count, error, seq{created_col})
SELECT g, 'transition', x.t + e.dt, e.f,
       CASE WHEN e.seq < 5 THEN e.t WHEN g %% 20 = 0 THEN 'failed' ELSE 'done' END,
       e.actor, e.lv, e.rc,
       CASE WHEN e.seq = 3 THEN 'bench: transient error'
            WHEN e.seq = 5 AND g %% 20 = 0 THEN 'bench: permanent error' END,
       e.seq{created}
FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g,
     LATERAL (SELECT %(start)s::timestamptz + %(span)s::interval * (g::float8 / %(n)s)) AS x(t),
     (VALUES (1, interval '0', NULL, 'queued', 'api', 0, 0),
             (2, interval '1 second', 'queued', 'processing', 'worker:bench', 1, 0),
             (3, interval '2 seconds', 'processing', 'queued', 'worker:bench', 2, 1),
             (4, interval '3 seconds', 'queued', 'processing', 'worker:bench', 3, 1),
             (5, interval '4 seconds', 'processing', NULL, 'worker:bench', 3, 1)
     ) AS e(seq, dt, f, t, actor, lv, rc)
"""

_FILL_BACKLOG = """
INSERT INTO jobs_job (task, payload, queue, priority, max_retries, updated_by, status,
                      retry_count, lease_version)
SELECT 'echo', jsonb_build_object('q', g), 'default', (g %% 3) - 1, 3, 'api', 'queued', 0, 0
FROM generate_series(1, %s) AS g
"""


def fill(url: str, name: str, jobs: int, queued: int) -> dict[str, float]:
    """N - queued finished jobs with their history, then the backlog; seconds per part."""
    assert name.startswith(SCRATCH_PREFIX), name  # triggers are switched off only here
    from jobs.conf import settings

    finished = jobs - queued
    times: dict[str, float] = {}
    with psycopg.connect(url, autocommit=True) as c:
        start, span = fill_window(c)
        parted = is_partitioned(c)
        hot = getattr(settings, "JOBS_HOT_FINISHED_SECONDS", 0)
        if parted:
            prepare_partitions(c, start)
        # Finished jobs go to their period's partition, those of the last hour excepted
        # (the mover leaves them in jobs_job_hot for JOBS_HOT_FINISHED_SECONDS).
        columns = {
            "period_col": ", period" if parted else "",
            "period": (
                ", CASE WHEN t > now() - %(hot)s * interval '1 second' THEN 'infinity'::date "
                "ELSE date_trunc('week', t AT TIME ZONE 'UTC')::date END"
                if parted
                else ""
            ),
            "created_col": ", job_created_at" if parted else "",
            "created": ", x.t" if parted else "",
        }
        started = time.monotonic()
        c.execute("SET session_replication_role = replica")
        for lo in range(1, finished + 1, CHUNK):
            hi = min(finished, lo + CHUNK - 1)
            args = {"lo": lo, "hi": hi, "n": finished, "start": start, "span": span, "hot": hot}
            with c.transaction():
                c.execute(_FILL_JOBS.format(**columns), args)
                c.execute(_FILL_HISTORY.format(**columns), args)
            log(f"  {hi:,} / {finished:,} finished jobs")
        c.execute("SET session_replication_role = DEFAULT")
        for table in ("jobs_job", "jobs_jobevent"):
            c.execute(
                f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), max(id)) FROM {table}"
            )
        times["finished_seconds"] = time.monotonic() - started
        started = time.monotonic()
        c.execute(_FILL_BACKLOG, [queued])
        times["backlog_seconds"] = time.monotonic() - started
        started = time.monotonic()
        c.execute("VACUUM (ANALYZE) jobs_job")
        c.execute("VACUUM (ANALYZE) jobs_jobevent")
        c.execute("CHECKPOINT")
        times["vacuum_seconds"] = time.monotonic() - started
    return times


def fill_window(conn: psycopg.Connection) -> tuple[Any, timedelta]:
    """The fill's first instant, a Monday 00:00 UTC WEEKS weeks before this week's, and
    its length up to now: the oldest week is a whole period on both layouts."""
    return conn.execute(
        "SELECT w, now() - w FROM (SELECT (date_trunc('week', now() AT TIME ZONE 'UTC') "
        f"- interval '{WEEKS} weeks') AT TIME ZONE 'UTC' AS w) AS x"
    ).fetchone()


def is_partitioned(conn: psycopg.Connection) -> bool:
    kind = conn.execute("SELECT relkind FROM pg_class WHERE relname = 'jobs_job'").fetchone()
    return kind[0] == "p"


def prepare_partitions(conn: psycopg.Connection, start: Any) -> None:
    """Weekly partitions for the whole fill, as an installation partitioned since before
    it would have: the (empty) legacy history partition ends where the fill starts."""
    first = start.astimezone(UTC).date()
    conn.execute("ALTER TABLE jobs_jobevent DETACH PARTITION jobs_jobevent_legacy")
    conn.execute(
        "ALTER TABLE jobs_jobevent ATTACH PARTITION jobs_jobevent_legacy "
        f"FOR VALUES FROM (MINVALUE) TO ('{first} 00:00:00+00')"
    )
    from jobs import partitions

    weeks = {first + timedelta(days=7 * n) for n in range(WEEKS + 1)}
    partitions.ensure({partitions.JOBS: weeks, partitions.EVENTS: weeks})


# --- what one layout measures (the child process, Django on the scratch database) ------------


def relations(conn: psycopg.Connection, root: str) -> list[str]:
    """The tables holding root's rows: itself, or every leaf partition."""
    rows = conn.execute(
        "SELECT relid::regclass::text FROM pg_partition_tree(%s) WHERE isleaf", [root]
    ).fetchall()
    return [r[0] for r in rows] or [root]


def sizes(url: str) -> dict[str, Any]:
    """Heap, index and total bytes and dead tuples of the job and history tables."""
    out: dict[str, Any] = {}
    with psycopg.connect(url) as c:
        c.execute("SELECT pg_stat_force_next_flush()")
        for root, key in (("jobs_job", "jobs"), ("jobs_jobevent", "history")):
            rels = relations(c, root)
            heap, idx, total, dead, live = c.execute(
                """SELECT sum(pg_relation_size(r))::bigint, sum(pg_indexes_size(r))::bigint,
                          sum(pg_total_relation_size(r))::bigint, sum(s.n_dead_tup)::bigint,
                          sum(s.n_live_tup)::bigint
                   FROM unnest(%s::regclass[]) AS r
                   LEFT JOIN pg_stat_user_tables s ON s.relid = r""",
                [rels],
            ).fetchone()
            out[key] = {
                "partitions": len(rels),
                "heap_mb": round(heap / 2**20, 1),
                "indexes_mb": round(idx / 2**20, 1),
                "total_mb": round(total / 2**20, 1),
                "dead_tuples": int(dead or 0),
                "live_tuples_estimate": int(live or 0),
            }
        hot = (
            "jobs_job_hot"
            if c.execute("SELECT to_regclass('jobs_job_hot')").fetchone()[0]
            else None
        )
        if hot:
            heap, total, dead = c.execute(
                """SELECT pg_relation_size(relid), pg_total_relation_size(relid), n_dead_tup
                   FROM pg_stat_user_tables WHERE relname = 'jobs_job_hot'"""
            ).fetchone()
            out["hot"] = {
                "heap_mb": round(heap / 2**20, 1),
                "total_mb": round(total / 2**20, 1),
                "dead_tuples": dead,
            }
    return out


def claim_params(worker: str) -> dict[str, Any]:
    from jobs import services

    return {
        "queue": "default",
        "limit": 1,
        "worker": worker,
        "actor": services.worker_actor(worker),
        "start": None,
    }


def explain_claim() -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of the workers' claim statement, rolled back."""
    from django.db import connection, transaction

    try:
        from jobs.services.claims import plain
    except ImportError:  # the tree measured is from before jobs.services was a package
        from jobs import services as plain

    found: set[str] = set()

    def walk(node: Any) -> None:
        """Relations read or written; an UPDATE through a partitioned parent names the
        parent (no storage of its own) and lists the partitions it wrote as targets."""
        if isinstance(node, dict):
            if "Relation Name" in node and "Target Tables" not in node:
                found.add(node["Relation Name"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    params = claim_params("bench-explain")
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + plain._CLAIM_NEXT_SQL, params)
        text = "\n".join(r[0] for r in cur.fetchall())
        cur.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + plain._CLAIM_NEXT_SQL, params)
        doc = cur.fetchone()[0]
        walk(json.loads(doc) if isinstance(doc, str) else doc)
        transaction.set_rollback(True)
    jobs = sorted(r for r in found if r == "jobs_job" or r.startswith("jobs_job_"))
    return {"text": text, "relations": sorted(found), "job_relations": jobs}


def claims_under_load(claimers: int, seconds: float) -> dict[str, Any]:
    """`claimers` processes claim and complete one job at a time for `seconds`."""
    argv = [sys.executable, "-m", "bench.claimer", str(seconds)]
    env = {**os.environ, "LOG_LEVEL": "WARNING"}
    docs = released_together(argv, claimers, timeout=seconds + 120, env=env)
    timings = [t for d in docs for t in d["claims_ms"]]
    return {"claimers": claimers, "seconds": seconds, **percentiles(timings)}


def submissions(n: int) -> dict[str, Any]:
    """The service write path the API takes: one job per transaction, pushed on commit."""
    from django.db import transaction

    from jobs import services

    timings = []
    for i in range(n):
        t0 = time.perf_counter()
        with transaction.atomic():
            services.submit("echo", {"s": i})
        timings.append((time.perf_counter() - t0) * 1000)
    return percentiles(timings)


def churn(jobs: int) -> dict[str, Any]:
    """A day at this scale: submit → claim → heartbeat × 2 → complete, `jobs` of them."""
    from django.db import connection, transaction

    from jobs import services

    started = time.perf_counter()
    done = 0
    while done < jobs:
        n = min(CHURN_BATCH, jobs - done)
        with transaction.atomic():
            services.submit_many([services.NewJob("echo", {"c": i}) for i in range(n)])
        held = []
        while len(held) < n:
            got = services.claim_next("bench-churn", ["default"], min(50, n - len(held)))
            if not got:
                break
            held.extend(got)
        for _ in range(2):
            for i in range(0, len(held), 50):
                services.heartbeat(held[i : i + 50])
        services.complete([(lease, {"ok": True}) for lease in held])
        done += n
    moved = after_churn()
    with connection.cursor() as cur:  # this session's counts reach pg_stat_user_tables
        cur.execute("SELECT pg_stat_force_next_flush()")
    time.sleep(1.0)
    return {"jobs": jobs, "seconds": round(time.perf_counter() - started, 1), "mover": moved}


def after_churn() -> dict[str, Any]:
    """On the partitioned layout, the reaper's mover takes the day's finished jobs out of
    jobs_job_hot: all of them, as a day is longer than JOBS_HOT_FINISHED_SECONDS."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT relkind FROM pg_class WHERE relname = 'jobs_job'")
        if cur.fetchone()[0] != "p":
            return {}
    from jobs import partitions

    started = time.perf_counter()
    moved = 0
    while n := partitions.move_batch(hot_seconds=0):
        moved += n
    return {"jobs": moved, "seconds": round(time.perf_counter() - started, 1)}


def vacuum_dirty(url: str) -> dict[str, Any]:
    """VACUUM each job table the churn left dead tuples in, as autovacuum would pick
    them (this server runs with autovacuum off, so the churn's dead tuples stay)."""
    with psycopg.connect(url, autocommit=True) as c:
        dirty = [
            r[0]
            for r in c.execute(
                """SELECT relid::regclass::text FROM pg_stat_user_tables
                   WHERE relid = ANY(%s::regclass[]) AND n_dead_tup > 0 ORDER BY 1""",
                [relations(c, "jobs_job")],
            )
        ]
        started = time.monotonic()
        for table in dirty:
            c.execute(f"VACUUM {table}")
        seconds = time.monotonic() - started
    return {"tables": dirty, "seconds": round(seconds, 2)}


def retention(url: str) -> dict[str, Any]:
    """The oldest week (and a minute, so its last jobs have finished): DELETE in batches
    by prunejobs on today's layout; detach + archive + drop on the partitioned one."""
    with psycopg.connect(url) as c:
        start, _ = fill_window(c)
        older = c.execute(
            "SELECT extract(epoch FROM now() - %s::timestamptz - interval '7 days 1 minute')",
            [start],
        ).fetchone()[0]
        older = int(older)
        parted = is_partitioned(c)
        before = c.execute("SELECT count(*) FROM jobs_job").fetchone()[0]
        history = c.execute("SELECT count(*) FROM jobs_jobevent").fetchone()[0]
    out: dict[str, Any] = {}
    started = time.monotonic()
    if parted:
        from jobs.archive import archive_expired

        with tempfile.TemporaryDirectory(prefix="jobservice-growth-archive-") as where:
            report = archive_expired(older, where)
            out["method"] = "jobs.archive.archive_expired (DETACH CONCURRENTLY, Parquet, drop)"
            out["periods"] = [str(p.period) for p in report.archived]
            out["steps_seconds"] = {
                step: round(sum(p.seconds.get(step, 0.0) for p in report.archived), 2)
                for p in report.archived[:1]
                for step in p.seconds
            }
            out["archive_mb"] = round(sum(p.bytes for p in report.archived) / 2**20, 1)
    else:
        from django.core.management import call_command

        call_command("prunejobs", "--older-than", f"{older}s", stdout=open(os.devnull, "w"))
        out["method"] = f"manage.py prunejobs --older-than {older}s (DELETE in batches)"
    out["seconds"] = round(time.monotonic() - started, 2)
    with psycopg.connect(url) as c:
        out["jobs"] = before - c.execute("SELECT count(*) FROM jobs_job").fetchone()[0]
        out["history_rows"] = (
            history - c.execute("SELECT count(*) FROM jobs_jobevent").fetchone()[0]
        )
    return out


def measure_layout(args: argparse.Namespace) -> dict[str, Any]:
    db = ScratchDatabase("tablegrowth", args.admin_url, name=args.db)
    assert db.name.startswith(SCRATCH_PREFIX), db.name
    with psycopg.connect(args.admin_url) as c:
        busy = c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", [db.name])
        if busy.fetchone()[0]:
            raise SystemExit(f"{db.name} is in use (another table-growth run?): not dropped")
    db.create()
    url = db.url()
    report: dict[str, Any] = {"layout": args.layout, "jobs": args.jobs, "database": db.name}
    try:
        os.environ.update(DATABASE_URL=url, DJANGO_SETTINGS_MODULE="jobservice.settings")
        import django

        django.setup()
        from django.core.management import call_command

        from jobs.migrations import __path__ as migrations_path

        latest = sorted(p.name for p in Path(migrations_path[0]).glob("0*.py"))[-1]
        started = time.monotonic()
        call_command("migrate", verbosity=0, interactive=False)
        report["migration"] = latest.removesuffix(".py")
        report["migrate_seconds"] = round(time.monotonic() - started, 1)

        queued = backlog(args.jobs)
        log(f"{args.layout}: fill {args.jobs:,} jobs ({queued:,} queued) into {db.name}")
        times = fill(url, db.name, args.jobs, queued)
        report["fill"] = {k: round(v, 1) for k, v in times.items()}
        report["fill"]["jobs_per_second"] = round(args.jobs / times["finished_seconds"])
        from jobs import services

        report["processing"] = len(services.claim_next("bench-holder", ["default"], 32))
        filled = sizes(url)
        report["after_fill"] = filled
        total = filled["jobs"]["total_mb"] + filled["history"]["total_mb"]
        report["gb_per_million_jobs"] = round(total / 1024 / (args.jobs / 1e6), 2)

        log(f"{args.layout}: EXPLAIN, claims, submissions")
        report["explain"] = explain_claim()
        report["claim"] = claims_under_load(args.claimers, args.seconds)
        report["submit"] = submissions(args.submissions)

        day = max(CHURN_BATCH, args.jobs // DAYS)
        log(f"{args.layout}: a day's churn, {day:,} jobs")
        report["churn"] = churn(day)
        report["churn"]["scale"] = f"{day:,} jobs = 1 day at {args.jobs:,} jobs / {WEEKS} weeks"
        report["after_churn"] = sizes(url)
        report["vacuum"] = vacuum_dirty(url)

        log(f"{args.layout}: retention of the oldest week")
        report["retention"] = retention(url)
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep_db:
            db.drop()
    return report


def child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.table_growth")
    p.add_argument("--layout", choices=["today", "partitioned"], required=True)
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--db", required=True, help="the scratch database (dropped and re-created)")
    p.add_argument("--admin-url", default=DEFAULT_ADMIN_URL)
    p.add_argument("--claimers", type=int, default=4)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--submissions", type=int, default=2000)
    p.add_argument("--keep-db", action="store_true")
    args = p.parse_args(argv)
    report = measure_layout(args)
    print(json.dumps(report, default=str))
    return 0


# --- the scenario: both layouts, one after the other -----------------------------------------


def today_ref() -> str | None:
    """The commit before the first jobs migration after 0020, or None when this tree is
    still today's layout."""
    out = subprocess.run(
        [
            "git",
            "-C",
            str(ROOT),
            "log",
            "--diff-filter=A",
            "--format=%H",
            "--reverse",
            "--",
            "jobs/migrations/002[1-9]_*.py",
            "jobs/migrations/00[3-9]?_*.py",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return f"{out[0]}^" if out else None


def run_layout(
    layout: str, root: Path, env: dict[str, str], options: list[str], suffix: str = ""
) -> dict:
    db = f"{SCRATCH_PREFIX}{checkout_tag()}_{layout}{suffix}"
    argv = [sys.executable, "-m", "bench.table_growth", "--layout", layout, "--db", db, *options]
    proc = subprocess.run(argv, cwd=root, env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{layout} layout failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def layouts(ctx: Any) -> Iterator[dict[str, Any]]:
    from bench.env import Code

    jobs = ctx.args.growth_jobs or (20_000 if ctx.quick else DEFAULT_JOBS)
    options = ["--jobs", str(jobs), "--admin-url", ctx.db.admin_url]
    if ctx.quick:
        options += ["--seconds", "2", "--submissions", "200"]
    if ctx.args.claimers:
        options += ["--claimers", str(ctx.args.claimers)]
    env = {k: v for k, v in ctx.procs.env.items() if not k.startswith("DJANGO_")}
    env.update(PYTHONPATH="", LOG_LEVEL="WARNING", DJANGO_SETTINGS_MODULE="jobservice.settings")
    wanted = ctx.args.growth_layout or ["today", "partitioned"]
    suffix = "_quick" if ctx.quick else ""  # the suite's smoke run beside a long one
    ref = today_ref()
    if "today" in wanted:
        code = Code(ref) if ref else None
        try:
            yield run_layout("today", code.root if code else ROOT, env, options, suffix)
        finally:
            if code:
                code.close()
    if "partitioned" in wanted and ref:
        yield run_layout("partitioned", ROOT, env, options, suffix)


def figure(name: str, value: float, unit: str, summary: str, **extra: Any) -> dict[str, Any]:
    """A bench record: what was measured, its value and unit, and how it came out."""
    return {"figure": name, "value": float(value), "unit": unit, "summary": summary, **extra}


def records(report: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """One record per figure of one layout's report."""
    layout, n = report["layout"], report["jobs"]
    at = f"{layout} layout, {n:,} jobs"
    fill = report["fill"]
    yield figure(
        f"{at}: fill rate (SQL, triggers off), finished jobs with 5 history rows",
        fill["jobs_per_second"],
        "jobs/s",
        f"finished {fill['finished_seconds']}s, backlog {fill['backlog_seconds']}s, "
        f"VACUUM ANALYZE {fill['vacuum_seconds']}s",
    )
    sizes_ = report["after_fill"]
    yield figure(
        f"{at}: disk per million jobs (jobs + history, tables + indexes)",
        report["gb_per_million_jobs"],
        "GB",
        f"jobs {sizes_['jobs']['total_mb']:,} MB in {sizes_['jobs']['partitions']} "
        f"table(s), history {sizes_['history']['total_mb']:,} MB",
    )
    claim = report["claim"]
    yield figure(
        f"{at}: claim statement p99, {claim['claimers']} concurrent claimers",
        claim["p99"],
        "ms",
        fmt_pcts({k: v for k, v in claim.items() if k not in ("claimers", "seconds")}),
    )
    yield figure(
        f"{at}: submission p99 (services.submit, one job per transaction)",
        report["submit"]["p99"],
        "ms",
        fmt_pcts(report["submit"]),
    )
    churned = report["after_churn"]
    yield figure(
        f"{at}: dead tuples in the job tables after a day's churn",
        churned["jobs"]["dead_tuples"],
        "tuples",
        f"{report['churn']['scale']} in {report['churn']['seconds']}s; jobs "
        f"{churned['jobs']['total_mb']:,} MB (heap {churned['jobs']['heap_mb']:,}), history "
        f"{churned['history']['total_mb']:,} MB"
        + (f"; hot table {churned['hot']}" if "hot" in churned else ""),
    )
    vacuumed = report["vacuum"]
    yield figure(
        f"{at}: VACUUM of the job tables the day's churn dirtied",
        vacuumed["seconds"],
        "s",
        ", ".join(vacuumed["tables"]),
    )
    kept = report["retention"]
    yield figure(
        f"{at}: retention of the oldest week",
        kept["seconds"],
        "s",
        f"{kept['method']}: {kept['jobs']:,} jobs, {kept['history_rows']:,} history rows",
    )
    explain = report["explain"]
    yield figure(
        f"{at}: job tables the claim's EXPLAIN (ANALYZE, BUFFERS) touches",
        len(explain["job_relations"]),
        "tables",
        ", ".join(explain["job_relations"]) + "\n" + explain["text"],
        details=explain,
    )


@scenario("table-growth")
def table_growth(ctx: Any) -> Iterator[dict[str, Any]]:
    reports = []
    for report in layouts(ctx):
        reports.append(report)
        for record in records(report):
            record["details"] = {**record.get("details", {}), "report": report}
            yield record
    names = "-".join(r["layout"] for r in reports)
    out = ROOT / "bench" / "results" / f"table_growth-{reports[0]['jobs']}-{names}.json"
    out.write_text(json.dumps(reports, indent=2, default=str))
    log(f"reports written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
