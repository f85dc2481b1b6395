"""Debounce: submissions with one `debounce_key` gather into one job that runs
`debounce_seconds` after the last of them, with the last one's payload (at the latest
`debounce_max_wait` after the first, when given).

The key's jobs_debounce row is the lock: each submission inserts it if missing, then
locks it (FOR UPDATE), so submissions of a key take turns in any number of API
processes. Under it, the job the row names is locked too; while it is still queued
the submission moves its run_at and replaces its payload (the submission joined it),
otherwise (a worker claimed it, or it ended) the submission makes a new job and the
row names that one. A claim skips a locked row (SKIP LOCKED), and a join waits for a
claim that holds the job and then sees it processing: a job never changes after its
attempt began. Times are the database's.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.db import connection

from jobs import lifecycle
from jobs.exceptions import DebounceConflict
from jobs.lifecycle import Status
from jobs.models import Debounce, Job

D = Debounce._meta.db_table
T = Job._meta.db_table

_ENSURE_SQL = f"INSERT INTO {D} (client_key, key) VALUES (%s, %s) ON CONFLICT DO NOTHING"
_LOCK_SQL = (
    f"SELECT id, job_id, first_at, statement_timestamp() FROM {D} "
    "WHERE client_key = %s AND key = %s FOR UPDATE"
)
_HELD_SQL = (
    f"SELECT status, task, queue FROM {T} WHERE id = %s AND {lifecycle.hot_sql()} FOR UPDATE"
)
_JOIN_SQL = f"""
UPDATE {T} SET payload = %(payload)s::jsonb, run_at = %(run_at)s,
       due_at = greatest(created_at, %(run_at)s), updated_by = %(actor)s
WHERE id = %(id)s AND status = '{Status.QUEUED}' AND {lifecycle.hot_sql()}"""
_NAME_SQL = f"UPDATE {D} SET job_id = %s, first_at = %s WHERE id = %s"


def submit(
    item: dict[str, Any],
    client_key: int,
    actor: str,
    insert: Callable[[datetime], tuple[Job, bool]],
) -> tuple[Job, bool]:
    """Join the key's waiting job (→ (job, False), `job.debounced` set) or make one with
    `insert(run_at)` (→ (job, True)). Call inside a transaction."""
    key = item["debounce_key"]
    wait = timedelta(seconds=item["debounce_seconds"])
    with connection.cursor() as cur:
        row = None
        while row is None:  # the reaper may prune the row between the two (D361)
            cur.execute(_ENSURE_SQL, [client_key, key])
            cur.execute(_LOCK_SQL, [client_key, key])
            row = cur.fetchone()
        row_id, job_id, first_at, now = row
        if job_id is not None:
            cur.execute(_HELD_SQL, [job_id])
            held = cur.fetchone()
            if held is not None and held[0] == Status.QUEUED:
                if (held[1], held[2]) != (item["task"], item["queue"]):
                    raise DebounceConflict(key, job_id)
                run_at = now + wait
                if item["debounce_max_wait"] is not None:
                    run_at = min(run_at, first_at + timedelta(seconds=item["debounce_max_wait"]))
                cur.execute(
                    _JOIN_SQL,
                    {"payload": item["payload_json"], "run_at": run_at, "actor": actor,
                     "id": job_id},
                )  # fmt: skip
                job = Job.objects.get(pk=job_id)
                job.debounced = True
                return job, False
        job, created = insert(now + wait)
        cur.execute(_NAME_SQL, [job.pk, now, row_id])
    return job, created
