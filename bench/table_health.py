#!/usr/bin/env python
"""Does jobs_job stay healthy with millions of finished rows? Measure it.

    .venv/bin/python bench/table_health.py --rows 1000000      (or: make table-health N=...)

In a scratch database of its own (default `jobservice_tablehealth_<checkout>`, named after
this checkout so two checkouts on one server never share it; dropped and re-created,
migrated with `manage.py migrate`), it:

1. bulk-loads N finished jobs (90 % done, 10 % failed, finished over the last 30
   days) and their three history rows each, with `INSERT ... SELECT generate_series`.
   To load quickly the lifecycle trigger is disabled for the load ONLY, and ONLY in
   this scratch database (`ALTER TABLE jobs_job DISABLE TRIGGER USER`), then
   re-enabled; the script refuses any database whose name does not start with
   `jobservice_tablehealth`. The rows satisfy every check constraint;
2. inserts Q queued jobs the ordinary way (trigger on);
3. measures: table and index sizes, claim and complete latency (p50/p99) through
   `jobs.services.claim_next` / `complete` (the workers' own code), the reaper's
   expired-lease sweep, the share of heartbeat and transition updates that are HOT;
4. runs `manage.py prunejobs --older-than 7d`, measures again, runs a plain
   VACUUM, and measures once more.

Results are printed and written to bench/results/table_health-<N>.json.
Not part of `make test`: with N = 1,000,000 it takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

ROOT = Path(__file__).resolve().parent.parent
SCRATCH_PREFIX = "jobservice_tablehealth"
CHUNK = 1_000_000


def default_db() -> str:
    """One scratch database per checkout: two checkouts' runs on one server must not drop
    each other's tables mid-measurement."""
    from harness.scratch import checkout_tag

    return f"{SCRATCH_PREFIX}_{checkout_tag()}"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


def ms(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": round(pct(values, 50) * 1000, 3),
        "p99_ms": round(pct(values, 99) * 1000, 3),
        "max_ms": round(max(values) * 1000, 3) if values else float("nan"),
        "mean_ms": round(statistics.fmean(values) * 1000, 3) if values else float("nan"),
    }


def mb(n: int) -> float:
    return round(n / 1024 / 1024, 1)


# --- the scratch database --------------------------------------------------------------


def create_scratch(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        c.execute(f'CREATE DATABASE "{name}"')


def scratch_url(admin_url: str, name: str) -> str:
    """The admin URL with the scratch database's name in place of its own."""
    u = urlsplit(admin_url)
    return urlunsplit((u.scheme, u.netloc, "/" + name, u.query, ""))


def drop_scratch(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def manage(db_url: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JOBS_", "DJANGO_"))}
    env.update(DATABASE_URL=db_url, REDIS_URL="", DJANGO_SETTINGS_MODULE="jobservice.settings")
    r = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if r.returncode != 0:
        raise SystemExit(f"manage.py {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r


def bulk_load(db_url: str, db_name: str, rows: int) -> float:
    """N finished jobs with their history, trigger disabled for the load only."""
    assert db_name.startswith(SCRATCH_PREFIX), db_name  # never anywhere else
    started = time.monotonic()
    with psycopg.connect(db_url, autocommit=True) as c:
        base = c.execute("SELECT coalesce(max(id), 0) FROM jobs_job").fetchone()[0]
        c.execute("ALTER TABLE jobs_job DISABLE TRIGGER USER")
        try:
            for lo in range(1, rows + 1, CHUNK):
                hi = min(rows, lo + CHUNK - 1)
                with c.transaction():
                    # Job g finished at now() - 30 days * (1 - g/N): oldest first, as in life.
                    c.execute(
                        """
                        INSERT INTO jobs_job (id, task, payload, queue, priority, status, result,
                            error, run_at, max_retries, retry_count, lease_version, created_at,
                            updated_at, finished_at, updated_by)
                        SELECT %(base)s::bigint + g, 'echo', jsonb_build_object('n', g),
                               'default', 0,
                               CASE WHEN g %% 10 = 0 THEN 'failed' ELSE 'done' END,
                               CASE WHEN g %% 10 = 0 THEN NULL ELSE jsonb_build_object('n', g) END,
                               CASE WHEN g %% 10 = 0 THEN 'bench: permanent error' END,
                               t, 3, 0, 1, t, t + interval '2 seconds', t + interval '2 seconds',
                               'worker:bench'
                        FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g,
                             LATERAL (SELECT now() - interval '30 days'
                                             * (1 - g::float8 / %(n)s)) AS x(t)
                        """,
                        {"lo": lo, "hi": hi, "n": rows, "base": base},
                    )
                    c.execute(
                        """
                        INSERT INTO jobs_jobevent (job_id, kind, at, from_status, to_status, actor,
                                                   lease_version, retry_count, error)
                        SELECT j.id, 'transition', j.created_at + e.dt, e.f,
                               CASE WHEN e.t = 'final' THEN j.status ELSE e.t END,
                               e.actor, e.lv, 0, CASE WHEN e.t = 'final' THEN j.error END
                        FROM jobs_job j CROSS JOIN (VALUES
                            (interval '0', NULL, 'queued', 'api', 0),
                            (interval '1 second', 'queued', 'processing', 'worker:bench', 1),
                            (interval '2 seconds', 'processing', 'final', 'worker:bench', 1)
                        ) AS e(dt, f, t, actor, lv)
                        WHERE j.id BETWEEN %(base)s::bigint + %(lo)s AND %(base)s::bigint + %(hi)s
                        """,
                        {"lo": lo, "hi": hi, "base": base},
                    )
                log(f"  loaded {hi:,} / {rows:,} finished jobs")
        finally:
            c.execute("ALTER TABLE jobs_job ENABLE TRIGGER USER")
        enabled = c.execute(
            "SELECT bool_and(tgenabled = 'O') FROM pg_trigger "
            "WHERE tgrelid = 'jobs_job'::regclass AND NOT tgisinternal"
        ).fetchone()[0]
        assert enabled, "lifecycle triggers were not re-enabled"
        c.execute("SELECT setval('jobs_job_id_seq', (SELECT max(id) FROM jobs_job))")
    return time.monotonic() - started


def add_queued(db_url: str, n: int) -> None:
    """Queued jobs inserted the ordinary way: the trigger checks and records each."""
    with psycopg.connect(db_url) as c:
        c.execute(
            """INSERT INTO jobs_job (task, payload, queue, priority, max_retries, updated_by,
                                    status, retry_count, lease_version)
               SELECT 'echo', jsonb_build_object('q', g), 'default', (g %% 3) - 1, 3, 'api',
                      'queued', 0, 0
               FROM generate_series(1, %s) AS g""",
            [n],
        )


def try_pgstattuple(db_url: str) -> None:
    """Free-space figures need the pgstattuple extension (PostgreSQL contrib); optional."""
    try:
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
    except psycopg.Error as exc:
        log(f"  pgstattuple unavailable, free space not reported: {exc}")


def vacuum(db_url: str) -> float:
    started = time.monotonic()
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("VACUUM ANALYZE jobs_job")
        c.execute("VACUUM ANALYZE jobs_jobevent")
        # Flush the bulk writes now, so the checkpoint does not land inside a measurement.
        c.execute("CHECKPOINT")
    return time.monotonic() - started


def sizes(db_url: str) -> dict[str, Any]:
    with psycopg.connect(db_url) as c:
        c.execute("SELECT pg_stat_force_next_flush()")
        row = c.execute(
            """SELECT pg_relation_size('jobs_job_hot'), pg_indexes_size('jobs_job_hot'),
                      pg_total_relation_size('jobs_job_hot'),
                      (SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits
                       WHERE inhparent = 'jobs_jobevent'::regclass),
                      (SELECT count(*) FROM jobs_job),
                      (SELECT count(*) FROM jobs_jobevent)"""
        ).fetchone()
        indexes = {  # the hot partition's, named after the parent's (0021)
            name.removeprefix("jobs_job_hot_"): size
            for name, size in c.execute(
                """SELECT indexrelid::regclass::text, pg_relation_size(indexrelid)
                   FROM pg_index WHERE indrelid = 'jobs_job_hot'::regclass ORDER BY 1"""
            ).fetchall()
        }
        by_status = dict(
            c.execute("SELECT status, count(*) FROM jobs_job GROUP BY status ORDER BY 1").fetchall()
        )
        dead = c.execute(
            "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'jobs_job_hot'"
        ).fetchone()[0]
        free = None
        if c.execute("SELECT 1 FROM pg_extension WHERE extname = 'pgstattuple'").fetchone():
            free = c.execute("SELECT free_percent FROM pgstattuple('jobs_job_hot')").fetchone()[0]
    return {
        "jobs_rows": row[4],
        "by_status": by_status,
        "jobs_heap_mb": mb(row[0]),
        "jobs_indexes_mb": mb(row[1]),
        "jobs_total_mb": mb(row[2]),
        "history_rows": row[5],
        "history_total_mb": mb(row[3]),
        "jobs_dead_tuples": dead,
        "jobs_free_percent": free,
        "index_mb": {k: mb(v) for k, v in indexes.items()},
    }


# --- measurements through the services (Django, the workers' own code) -------------------


def setup_django(db_url: str) -> None:
    os.environ.update(DATABASE_URL=db_url, REDIS_URL="")
    os.environ["DJANGO_SETTINGS_MODULE"] = "jobservice.settings"
    os.environ.pop("JOBS_PRODUCTION", None)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def measure_services(db_url: str, claims: int) -> dict[str, Any]:
    from django.db import connection

    from jobs import services

    def table_updates() -> tuple[int, int]:
        """(updates, HOT updates) on jobs_job so far, after flushing this backend's counts."""
        with connection.cursor() as cur:
            cur.execute("SELECT pg_stat_force_next_flush()")
        time.sleep(0.3)
        with psycopg.connect(db_url) as c:
            return c.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                "WHERE relname = 'jobs_job_hot'"
            ).fetchone()

    with connection.cursor() as cur:
        cur.execute(
            "EXPLAIN SELECT id FROM jobs_job WHERE status = 'queued' AND queue = 'default' "
            "AND run_at <= now() ORDER BY priority DESC, run_at, id LIMIT 1 FOR UPDATE SKIP LOCKED"
        )
        plan = "\n".join(r[0] for r in cur.fetchall())

    # Claim + complete, one job at a time, each its own transaction (as a worker does).
    claim_t, complete_t = [], []
    for _ in range(claims):
        t0 = time.perf_counter()
        leases = services.claim_next("bench-worker", ["default"], 1)
        t1 = time.perf_counter()
        if not leases:
            raise SystemExit("ran out of queued jobs; raise --queued")
        services.complete([(leases[0], {"ok": True})])
        t2 = time.perf_counter()
        claim_t.append(t1 - t0)
        complete_t.append(t2 - t1)

    # The reaper's expired-lease sweep with 50 jobs running.
    held = services.claim_next("bench-worker", ["default"], 50)
    reap_t = []
    for _ in range(50):
        t0 = time.perf_counter()
        services.reap_expired(15.0)
        reap_t.append(time.perf_counter() - t0)

    # HOT share of heartbeats and of transitions, each write its own transaction.
    u0, h0 = table_updates()
    for _ in range(10):
        assert len(services.heartbeat(held)) == len(held)
    u1, h1 = table_updates()
    services.complete([(lease, {"ok": True}) for lease in held])
    for _ in range(50):
        services.complete([(x, {"ok": True}) for x in services.claim_next("bw", ["default"], 1)])
    u2, h2 = table_updates()

    t0 = time.perf_counter()
    with connection.cursor() as cur:
        cur.execute(
            "SELECT status, count(*) FROM jobs_job "
            "WHERE status IN ('queued', 'processing', 'enqueue_failed') GROUP BY status"
        )
        cur.fetchall()
    depth_t = time.perf_counter() - t0

    return {
        "loadavg_1m": round(os.getloadavg()[0], 2),  # the machine is shared: context for p99
        "claim_plan_uses_partial_index": "job_claim_idx" in plan,
        "claim": ms(claim_t),
        "complete": ms(complete_t),
        "reaper_sweep": ms(reap_t),
        "queue_depth_query_ms": round(depth_t * 1000, 3),
        "heartbeat_updates": u1 - u0,
        "heartbeat_hot_share": round((h1 - h0) / max(1, u1 - u0), 3),
        "transition_updates": u2 - u1,
        "transition_hot_share": round((h2 - h1) / max(1, u2 - u1), 3),
    }


def prune(db_url: str, older_than: str, batch: int) -> dict[str, Any]:
    started = time.monotonic()
    r = manage(db_url, "prunejobs", "--older-than", older_than, "--batch", str(batch))
    lines = r.stdout.strip().splitlines()
    return {"seconds": round(time.monotonic() - started, 1), "summary": lines[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="finished jobs to load")
    ap.add_argument("--queued", type=int, default=20_000, help="queued jobs beside them")
    ap.add_argument("--claims", type=int, default=2_000, help="claim+complete samples per phase")
    ap.add_argument("--db", default=default_db(), help="scratch database (dropped!)")
    ap.add_argument(
        "--admin-url",
        default=os.environ.get("TABLE_HEALTH_ADMIN_URL", "postgres://root@127.0.0.1:5432/postgres"),
        help="a connection to the server that may create databases",
    )
    ap.add_argument("--older-than", default="7d", help="prunejobs --older-than")
    ap.add_argument("--batch", type=int, default=10_000, help="prunejobs --batch")
    ap.add_argument("--keep", action="store_true", help="keep the scratch database")
    args = ap.parse_args()
    if not args.db.startswith(SCRATCH_PREFIX):
        raise SystemExit(f"--db must start with {SCRATCH_PREFIX}: this script disables triggers")
    if args.queued < 4 * (args.claims + 150):
        raise SystemExit("--queued must be at least 4 * (--claims + 150): four phases claim")

    db_url = scratch_url(args.admin_url, args.db)
    report: dict[str, Any] = {"rows": args.rows, "queued": args.queued, "claims": args.claims}
    log(f"scratch database {args.db}: create and migrate")
    create_scratch(args.admin_url, args.db)
    try:
        manage(db_url, "migrate", "--noinput")
        try_pgstattuple(db_url)
        add_queued(db_url, args.queued)
        vacuum(db_url)
        setup_django(db_url)
        log("measure: baseline, no finished jobs yet")
        report["baseline"] = {
            "sizes": sizes(db_url),
            "services": measure_services(db_url, args.claims),
        }
        log(f"bulk load of {args.rows:,} finished jobs (trigger disabled in {args.db} only)")
        report["load_seconds"] = round(bulk_load(db_url, args.db, args.rows), 1)
        report["vacuum_after_load_seconds"] = round(vacuum(db_url), 1)

        log("measure: before pruning")
        report["before"] = {
            "sizes": sizes(db_url),
            "services": measure_services(db_url, args.claims),
        }
        log(f"prunejobs --older-than {args.older_than} --batch {args.batch}")
        report["prune"] = prune(db_url, args.older_than, args.batch)
        log("measure: after pruning (autovacuum may be at work)")
        report["after_prune"] = {
            "sizes": sizes(db_url),
            "services": measure_services(db_url, args.claims),
        }
        report["vacuum_after_prune_seconds"] = round(vacuum(db_url), 1)
        log("measure: after VACUUM")
        report["after_vacuum"] = {
            "sizes": sizes(db_url),
            "services": measure_services(db_url, args.claims),
        }
    finally:
        if "django" in sys.modules and sys.modules["django"].apps.apps.ready:
            from django.db import connections

            connections.close_all()
        if not args.keep:
            drop_scratch(args.admin_url, args.db)

    out = ROOT / "bench" / "results" / f"table_health-{args.rows}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print_summary(report)
    log(f"written to {out.relative_to(ROOT)}")


def print_summary(r: dict[str, Any]) -> None:
    phases = [r["baseline"], r["before"], r["after_prune"], r["after_vacuum"]]

    def size(key: str) -> list[Any]:
        return [p["sizes"][key] for p in phases]

    def svc(*keys: str) -> list[Any]:
        out = []
        for p in phases:
            v = p.get("services")
            for k in keys:
                v = v[k] if v else None
            out.append("" if v is None else v)
        return out

    rows = [
        ("jobs rows", size("jobs_rows")),
        ("jobs heap MB", size("jobs_heap_mb")),
        ("jobs indexes MB", size("jobs_indexes_mb")),
        ("job_claim_idx MB", [p["sizes"]["index_mb"]["job_claim_idx"] for p in phases]),
        ("jobs free space %", size("jobs_free_percent")),
        ("jobs dead tuples", size("jobs_dead_tuples")),
        ("history rows", size("history_rows")),
        ("history total MB", size("history_total_mb")),
        ("claim p50 ms", svc("claim", "p50_ms")),
        ("claim p99 ms", svc("claim", "p99_ms")),
        ("complete p50 ms", svc("complete", "p50_ms")),
        ("complete p99 ms", svc("complete", "p99_ms")),
        ("reaper sweep p99 ms", svc("reaper_sweep", "p99_ms")),
        ("queue depth query ms", svc("queue_depth_query_ms")),
        ("heartbeat HOT share", svc("heartbeat_hot_share")),
        ("machine load (1 min)", svc("loadavg_1m")),
        ("transition HOT share", svc("transition_hot_share")),
    ]
    print(
        f"\n{r['rows']:,} finished + {r['queued']:,} queued jobs; load {r['load_seconds']} s; "
        f"{r['prune']['summary']}; vacuum after prune {r['vacuum_after_prune_seconds']} s"
    )
    heads = ["no history", "before prune", "after prune", "after vacuum"]
    print(f"{'':22}" + "".join(f"{h:>15}" for h in heads))
    for name, vals in rows:
        print(f"{name:22}" + "".join(f"{'' if x is None else x!s:>15}" for x in vals))
    uses = [p["services"]["claim_plan_uses_partial_index"] for p in phases if "services" in p]
    print(f"claim plan uses job_claim_idx in every phase: {all(uses)}")


if __name__ == "__main__":
    main()
