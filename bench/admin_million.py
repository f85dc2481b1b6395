"""Time the admin console on a million jobs.

    .venv/bin/python bench/admin_million.py [--rows 1000000] [--rebuild] [--drop]

Builds (once) a database `jobservice_admin_bench` on the PostgreSQL of
DATABASE_URL (default 127.0.0.1, user root) with `--rows` jobs walked through
legal transitions (mostly done, some failed, queued, processing, enqueue_failed),
then times the job list under each filter, the search, a detail page and the
dashboard through Django's test client, and prints the plan of each dashboard
query. Nothing here runs in `make test`; it is a measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DB = "jobservice_admin_bench"
os.environ.setdefault("DATABASE_URL", f"postgres://root@127.0.0.1:5432/{DB}")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "jobservice.settings")
os.environ.setdefault("ALLOWED_HOSTS", "testserver,127.0.0.1")

BUILD_SQL = """
INSERT INTO jobs_job (task, payload, queue, priority, run_at, max_retries, updated_by,
                      status, retry_count, lease_version, created_at, idempotency_key)
SELECT (ARRAY['echo','sleep','fail','resize','email'])[1 + i %% 5],
       jsonb_build_object('n', i),
       (ARRAY['default','default','default','high','low'])[1 + (i / 7) %% 5],
       (i %% 3) - 1, now() - (%(rows)s - i) * interval '50 ms', 3, 'api', 'queued', 0, 0,
       now() - (%(rows)s - i) * interval '50 ms', 'key-' || i
FROM generate_series(1, %(rows)s) AS i;
-- claim everything except the newest 1%% (stays queued) and every 997th (enqueue_failed)
UPDATE jobs_job SET status = 'processing', lease_version = 1, owned_by = 'w-bench',
       claimed_at = now(), heartbeat_at = now() - (id %% 60) * interval '1 second',
       updated_by = 'worker:w-bench'
WHERE id <= %(rows)s * 0.99 AND id %% 997 <> 0;
UPDATE jobs_job SET status = 'enqueue_failed', updated_by = 'api'
WHERE status = 'queued' AND id %% 997 = 0;
-- finish all but the newest 500 processing rows: 98%% done, 2%% failed
UPDATE jobs_job SET status = CASE WHEN id %% 50 = 0 THEN 'failed' ELSE 'done' END,
       error = CASE WHEN id %% 50 = 0 THEN 'boom' ELSE NULL END,
       result = CASE WHEN id %% 50 = 0 THEN NULL ELSE '{"ok": true}'::jsonb END,
       retry_count = CASE WHEN id %% 50 = 0 THEN 4 ELSE 0 END,
       finished_at = created_at + (id %% 40) * interval '1 second',
       owned_by = NULL, claimed_at = NULL, heartbeat_at = NULL, updated_by = 'worker:w-bench'
WHERE status = 'processing' AND id < (SELECT max(id) - 500 FROM jobs_job
                                       WHERE status = 'processing');
"""


def ensure_database(rebuild: bool, drop: bool, rows: int) -> None:
    import psycopg

    with psycopg.connect("postgresql://root@127.0.0.1:5432/postgres", autocommit=True) as c:
        exists = c.execute("SELECT 1 FROM pg_database WHERE datname = %s", [DB]).fetchone()
        if exists and (rebuild or drop):
            c.execute(f"DROP DATABASE {DB}")
            exists = None
        if drop:
            print(f"dropped {DB}")
            sys.exit(0)
        if not exists:
            c.execute(f"CREATE DATABASE {DB}")
            fresh = True
        else:
            fresh = False
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    if fresh:
        started = time.monotonic()
        with connection.cursor() as cur:
            cur.execute(BUILD_SQL, {"rows": rows})
            cur.execute("VACUUM ANALYZE jobs_job")
            cur.execute("VACUUM ANALYZE jobs_jobevent")
        print(f"built {rows} jobs in {time.monotonic() - started:.0f} s")


def timed(client, url: str, repeat: int = 3) -> tuple[float, int]:
    """Best-of-N wall time in ms and the query count of one GET."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    best = float("inf")
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as ctx:
            started = time.perf_counter()
            response = client.get(url)
            elapsed = (time.perf_counter() - started) * 1000
        assert response.status_code == 200, (url, response.status_code)
        best = min(best, elapsed)
    return best, len(ctx.captured_queries)


def time_select_across_retry(client) -> None:
    """Retry every failed job through the admin (select-across, filtered), then put
    them back with the cancel service so the bench database keeps its shape."""
    from django.db import connection

    url = "/admin/jobs/job/?status__exact=failed"
    with connection.cursor() as cur:
        cur.execute("SELECT id FROM jobs_job WHERE status = 'failed' ORDER BY id DESC LIMIT 100")
        page_ids = [r[0] for r in cur.fetchall()]
        cur.execute("SELECT count(*) FROM jobs_job WHERE status = 'failed'")
        failed = cur.fetchone()[0]
    data = {"action": "retry_jobs", "select_across": "1", "_selected_action": page_ids}
    started = time.perf_counter()
    response = client.post(url, data)
    confirm_ms = (time.perf_counter() - started) * 1000
    assert response.status_code == 200
    started = time.perf_counter()
    response = client.post(url, {**data, "post": "yes"}, follow=True)
    run_s = time.perf_counter() - started
    html = response.content.decode()
    message = html[html.find('<ul class="messagelist">') :].split("</ul>")[0]
    message = " ".join(message.replace("<", " <").split())
    print(f"{'retry confirmation page':32} {confirm_ms:15.1f}")
    print(f"retry {failed} failed jobs via select-across: {run_s:.1f} s ({message})")
    restore()


def restore() -> None:
    from django.db import connection

    from jobs import services

    with connection.cursor() as cur:
        cur.execute(
            "SELECT id FROM jobs_job WHERE updated_by = 'staff:bench' AND status = 'queued'"
        )
        ids = [r[0] for r in cur.fetchall()]
    for i in range(0, len(ids), 1000):
        services.cancel(ids[i : i + 1000], "bench-restore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--drop", action="store_true", help="drop the bench database and exit")
    parser.add_argument(
        "--action",
        action="store_true",
        help="also time 'retry' with select-across over every failed job, then cancel "
        "them back to failed",
    )
    args = parser.parse_args()
    ensure_database(args.rebuild, args.drop, args.rows)

    from django.contrib.auth import get_user_model
    from django.core.cache import cache
    from django.db import connection
    from django.test import Client

    from jobs.admin import dashboard

    user_model = get_user_model()
    user = user_model.objects.filter(username="bench").first() or (
        user_model.objects.create_superuser("bench", "bench@example.invalid", "bench")
    )
    client = Client()
    client.force_login(user)
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM jobs_job")
        total = cur.fetchone()[0]
        cur.execute("SELECT max(id) FROM jobs_job WHERE status = 'failed'")
        failed_id = cur.fetchone()[0]
    print(f"jobs_job rows: {total}")
    urls = [
        ("list, unfiltered", "/admin/jobs/job/"),
        ("list, page 50", "/admin/jobs/job/?p=50"),
        ("status=failed", "/admin/jobs/job/?status__exact=failed"),
        ("status=queued", "/admin/jobs/job/?status__exact=queued"),
        ("stuck", "/admin/jobs/job/?stuck=yes"),
        ("task=resize", "/admin/jobs/job/?task=resize"),
        ("status=failed&task=fail", "/admin/jobs/job/?status__exact=failed&task=fail"),
        ("queue=high", "/admin/jobs/job/?queue=high"),
        ("queue=high&status=queued", "/admin/jobs/job/?queue=high&status__exact=queued"),
        ("search id", f"/admin/jobs/job/?q={failed_id}"),
        ("search idempotency key", "/admin/jobs/job/?q=key-123456"),
        ("failed, sorted by in_state", "/admin/jobs/job/?status__exact=failed&o=-11"),
        ("facets asked for (ignored)", "/admin/jobs/job/?_facets=True"),
        ("detail", f"/admin/jobs/job/{failed_id}/change/"),
    ]
    print(f"{'page':32} {'best of 3 (ms)':>15} {'queries':>8}")
    for name, url in urls:
        ms, n = timed(client, url)
        print(f"{name:32} {ms:15.1f} {n:8d}")
    cache.clear()
    ms, n = timed(client, "/admin/jobs/job/dashboard/", repeat=1)
    print(f"{'dashboard (cold cache)':32} {ms:15.1f} {n:8d}")
    ms, n = timed(client, "/admin/jobs/job/dashboard/")
    print(f"{'dashboard (cached)':32} {ms:15.1f} {n:8d}")
    if args.action:
        time_select_across_retry(client)
    print()
    for name, sql, params in dashboard.dashboard_queries():
        with connection.cursor() as cur:
            cur.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + sql, params)
            plan = [r[0] for r in cur.fetchall()]
        print(f"-- {name}")
        print("\n".join(plan))
        print()


if __name__ == "__main__":
    main()
