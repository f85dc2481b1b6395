#!/usr/bin/env python
"""Retention of one week's worth: DETACH + Parquet archive + DROP against row-wise DELETE,
on the same data.

    .venv/bin/python -m bench.archive_retention --jobs 1000000      (or: make archive-bench)

In a scratch database of its own (`jobservice_archret_<checkout>_<pid>`, dropped at the
end), migrated with `manage.py migrate`, it:

1. bulk-loads N finished jobs created in one period five weeks ago (90 % done, 10 %
   failed) with three history rows each, into that period's partitions (the history
   partition is made by moving the legacy bound back, as on a database partitioned for
   that long). The lifecycle triggers are disabled for the load only, in the scratch
   database only;
2. copies the database (`CREATE DATABASE … TEMPLATE`): two identical copies;
3. on one, runs the row-wise path as `prunejobs` ran it before partitions (batches of
   10,000 `DELETE … FOR UPDATE SKIP LOCKED` over jobs_job, history and side rows), then
   `VACUUM` (what the deleted rows need before their space is reused);
4. on the other, `manage.py prunejobs --older-than 7d` with JOBS_ARCHIVE_DIR set:
   DETACH CONCURRENTLY, Parquet, verify, DROP; then `manage.py archive show` of one job
   and `manage.py archive restore`.

Prints the figures and writes bench/results/archive_retention-<N>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg import sql

from harness.scratch import ScratchDatabase

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 500_000
WEEK = datetime.timedelta(days=7)

# The row-wise path as it was before partitions (jobs.services, issue 33's baseline).
OLD_PRUNE = """
WITH victims AS (
  SELECT id FROM jobs_job
  WHERE status = ANY(%(statuses)s) AND finished_at < now() - %(age)s * interval '1 second'
  LIMIT %(batch)s FOR UPDATE SKIP LOCKED),
ev AS (DELETE FROM jobs_jobevent WHERE job_id IN (SELECT id FROM victims)),
steps AS (DELETE FROM jobs_jobstep WHERE job_id IN (SELECT id FROM victims)),
sigs AS (DELETE FROM jobs_jobsignal WHERE job_id IN (SELECT id FROM victims)),
nodes AS (DELETE FROM jobs_workflownode WHERE job_id IN (SELECT id FROM victims)),
edges AS (DELETE FROM jobs_jobdependency
          WHERE child_id IN (SELECT id FROM victims) OR parent_id IN (SELECT id FROM victims)),
dl AS (DELETE FROM jobs_webhookdelivery WHERE job_id IN (SELECT id FROM victims)),
gone AS (DELETE FROM jobs_job WHERE id IN (SELECT id FROM victims) RETURNING 1)
SELECT count(*) FROM gone"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def manage(url: str, *args: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("JOBS_", "DJANGO_"))}
    full.update(DATABASE_URL=url, REDIS_URL="", DJANGO_SETTINGS_MODULE="jobservice.settings")
    full.update(env)
    r = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=full, capture_output=True, text=True
    )
    if r.returncode != 0:
        raise SystemExit(f"manage.py {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def monday(weeks_ago: int) -> datetime.date:
    today = datetime.datetime.now(datetime.UTC).date()
    return today - datetime.timedelta(days=today.weekday()) - weeks_ago * WEEK


def partitions_for(c: psycopg.Connection, start: datetime.date) -> None:
    """The period's job partition and a history partition for it: legacy's bound moves
    back to the period's start, with a history partition for each week up to it."""
    bound = c.execute(
        "SELECT pg_get_expr(relpartbound, oid) FROM pg_class WHERE relname = 'jobs_jobevent_legacy'"
    ).fetchone()[0]
    old = datetime.date.fromisoformat(re.search(r"TO \('(\d{4}-\d\d-\d\d)", bound).group(1))
    c.execute("ALTER TABLE jobs_jobevent DETACH PARTITION jobs_jobevent_legacy")
    c.execute(
        "ALTER TABLE jobs_jobevent ATTACH PARTITION jobs_jobevent_legacy "
        f"FOR VALUES FROM (MINVALUE) TO ('{start} 00:00:00+00')"
    )
    day = start
    while day < old:
        name = f"jobs_jobevent_p{day:%Y%m%d}"
        c.execute(
            f"CREATE TABLE {name} PARTITION OF jobs_jobevent "
            f"FOR VALUES FROM ('{day} 00:00:00+00') TO ('{day + WEEK} 00:00:00+00')"
        )
        c.execute(f"ALTER TABLE {name} ADD PRIMARY KEY (id)")
        day += WEEK
    name = f"jobs_job_p{start:%Y%m%d}"
    c.execute(
        f"CREATE TABLE {name} PARTITION OF jobs_job "
        f"FOR VALUES FROM ('{start}') TO ('{start + WEEK}')"
    )
    c.execute(f"ALTER TABLE {name} ADD PRIMARY KEY (id)")


def load(url: str, name: str, jobs: int, start: datetime.date) -> float:
    assert name.startswith("jobservice_archret_"), name  # triggers off: scratch only
    began = time.monotonic()
    with psycopg.connect(url, autocommit=True) as c:
        partitions_for(c, start)
        c.execute("ALTER TABLE jobs_job DISABLE TRIGGER USER")
        try:
            for lo in range(1, jobs + 1, CHUNK):
                hi = min(jobs, lo + CHUNK - 1)
                with c.transaction():
                    c.execute(
                        """
                        INSERT INTO jobs_job (id, task, payload, queue, priority, status, result,
                            error, run_at, max_retries, retry_count, lease_version, created_at,
                            updated_at, finished_at, updated_by, period)
                        SELECT g, 'echo', jsonb_build_object('n', g), 'default', 0,
                               CASE WHEN g %% 10 = 0 THEN 'failed' ELSE 'done' END,
                               CASE WHEN g %% 10 = 0 THEN NULL ELSE jsonb_build_object('n', g) END,
                               CASE WHEN g %% 10 = 0 THEN 'bench: permanent error' END,
                               t, 3, 0, 1, t, t + interval '2 seconds', t + interval '2 seconds',
                               'worker:bench', %(start)s
                        FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g,
                             LATERAL (SELECT %(start)s::timestamptz
                                             + interval '7 days' * (g::float8 / (%(n)s + 1))) x(t)
                        """,
                        {"lo": lo, "hi": hi, "n": jobs, "start": start},
                    )
                    c.execute(
                        """
                        INSERT INTO jobs_jobevent (job_id, kind, at, from_status, to_status, actor,
                                                   lease_version, retry_count, error, seq,
                                                   job_created_at)
                        SELECT j.id, 'transition', j.created_at + e.dt, e.f,
                               CASE WHEN e.t = 'final' THEN j.status ELSE e.t END,
                               e.actor, e.lv, 0, CASE WHEN e.t = 'final' THEN j.error END,
                               e.seq, j.created_at
                        FROM jobs_job j CROSS JOIN (VALUES
                            (interval '0', NULL, 'queued', 'api', 0, 1),
                            (interval '1 second', 'queued', 'processing', 'worker:bench', 1, 2),
                            (interval '2 seconds', 'processing', 'final', 'worker:bench', 1, 3)
                        ) AS e(dt, f, t, actor, lv, seq)
                        WHERE j.id BETWEEN %(lo)s AND %(hi)s
                        """,
                        {"lo": lo, "hi": hi},
                    )
                log(f"  loaded {hi:,} / {jobs:,} jobs")
        finally:
            c.execute("ALTER TABLE jobs_job ENABLE TRIGGER USER")
        c.execute("SELECT setval('jobs_job_id_seq', %s)", [jobs + 1])
        c.execute("VACUUM ANALYZE")
        c.execute("CHECKPOINT")
    return time.monotonic() - began


def sizes(url: str) -> dict[str, float]:
    with psycopg.connect(url) as c:
        return {
            "database_mb": round(
                c.execute("SELECT pg_database_size(current_database())").fetchone()[0] / 2**20, 1
            ),
            "jobs": c.execute("SELECT count(*) FROM jobs_job").fetchone()[0],
            "history": c.execute("SELECT count(*) FROM jobs_jobevent").fetchone()[0],
        }


def row_wise(url: str) -> dict[str, float]:
    began = time.monotonic()
    total = batches = 0
    with psycopg.connect(url, autocommit=True) as c:
        while True:
            n = c.execute(
                OLD_PRUNE, {"statuses": ["done", "failed"], "age": 7 * 86400, "batch": 10_000}
            ).fetchone()[0]
            total += n
            batches += 1
            if n < 10_000:
                break
        deleted = time.monotonic() - began
        t = time.monotonic()
        c.execute("VACUUM jobs_job")
        c.execute("VACUUM jobs_jobevent")
        vacuumed = time.monotonic() - t
    return {"jobs": total, "batches": batches, "delete_s": round(deleted, 1),
            "vacuum_s": round(vacuumed, 1)}  # fmt: skip


def by_partition(url: str, archive_dir: Path, start: datetime.date, jobs: int) -> dict:
    began = time.monotonic()
    out = manage(url, "prunejobs", "--older-than", "7d", JOBS_ARCHIVE_DIR=str(archive_dir))
    total = time.monotonic() - began
    steps = {
        m.group(1): float(m.group(2))
        for m in re.finditer(rf"period {start:%Y-%m-%d}: (\w+) ([\d.]+) s", out)
    }
    files = {
        p.name: round(p.stat().st_size / 2**20, 1)
        for p in (archive_dir / f"{start:%Y%m%d}").iterdir()
    }
    t = time.monotonic()
    shown = json.loads(manage(url, "archive", "show", str(jobs // 2)))
    show_s = time.monotonic() - t
    assert shown["job"]["id"] == jobs // 2 and len(shown["history"]) == 3, shown
    t = time.monotonic()
    manage(url, "archive", "restore", f"{start:%Y-%m-%d}")
    restored = time.monotonic() - t
    return {"command_s": round(total, 1), "steps_s": steps, "files_mb": files,
            "show_s": round(show_s, 1), "restore_s": round(restored, 1),
            "output": out}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--keep", action="store_true", help="Keep the scratch databases.")
    args = parser.parse_args()
    start = monday(5)
    a = ScratchDatabase("archret")
    a.drop_stale()
    a.create()
    b = ScratchDatabase("archret", name=a.name + "_b")
    archive_dir = Path(tempfile.mkdtemp(prefix="archret-"))
    try:
        log(f"scratch database {a.name}: migrate")
        manage(a.url(), "migrate", "--no-input")
        log(f"load {args.jobs:,} jobs (three history rows each) in the period of {start}")
        loaded = load(a.url(), a.name, args.jobs, start)
        log(f"  {loaded:.0f} s; copy to {b.name}")
        with psycopg.connect(a.admin_url, autocommit=True) as c:
            c.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(b.name), sql.Identifier(a.name)
                )
            )
        before = sizes(a.url())
        log(f"  {before}")
        log("row-wise DELETE (the path before partitions), then VACUUM")
        rw = row_wise(a.url())
        log(f"  {rw}")
        log("prunejobs: DETACH, Parquet, verify, DROP; then archive restore")
        bp = by_partition(b.url(), archive_dir, start, args.jobs)
        log(f"  { ({k: v for k, v in bp.items() if k != 'output'}) }")
        result = {"jobs": args.jobs, "period": str(start), "before": before,
                  "row_wise": rw, "by_partition": bp}  # fmt: skip
        path = ROOT / "bench" / "results" / f"archive_retention-{args.jobs}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        log(f"written {path}")
    finally:
        shutil.rmtree(archive_dir, ignore_errors=True)
        if not args.keep:
            b.drop()
            a.drop()


if __name__ == "__main__":
    main()
