"""Recovery, the reaper's sweeps: a lease that expired or whose worker is gone is
requeued (a started attempt spends a retry) or failed once the budget is spent, in one
statement with FOR UPDATE SKIP LOCKED and the lease bumped, so the late worker's writes
are fenced out. The worker registry lives here too: a worker's beat and its session
lock are how the reaper knows an owner is gone before its leases expire.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from typing import Any

import psycopg

from jobs import lifecycle, metrics
from jobs.lifecycle import NOT_STARTED, Role, Status
from jobs.logconfig import job_log_fields
from jobs.models import WorkerProcess
from jobs.services.common import (
    _FINISH_RETURNING,
    _UNOWN,
    Finished,
    T,
    _finished,
    _rows,
    signal_after_commit,
)

log = logging.getLogger(__name__)


def _reap(candidates: str, error: str, params: dict[str, Any]) -> list[tuple]:
    """Requeue or fail the processing rows `candidates` selects as (id, owned_by),
    FOR UPDATE SKIP LOCKED, lease bumped: the one recovery statement shared by lease
    expiry and dead-owner detection. A started attempt spends a retry (failed once the
    budget is spent); one whose handler was never called (prefetched) goes back to
    queued with no retry spent and its run_at kept, and its history says so (D77)."""
    started = "j.started_at IS NOT NULL"
    retry = f"(NOT {started} OR j.retry_count + 1 <= j.max_retries)"
    return _rows(
        f"""WITH {candidates}
            UPDATE {T} j SET
                   retry_count = j.retry_count + CASE WHEN {started} THEN 1 ELSE 0 END,
                   result = NULL,
                   error = CASE WHEN {started} THEN {error}
                                ELSE {error} || '; {NOT_STARTED}' END,
                   status = CASE WHEN {retry} THEN '{Status.QUEUED}' ELSE '{Status.FAILED}' END,
                   lease_version = j.lease_version + 1,
                   run_at = CASE WHEN {started} AND {retry} THEN now() ELSE j.run_at END,
                   finished_at = CASE WHEN {retry} THEN NULL ELSE now() END,
                   {_UNOWN}, updated_by = '{Role.REAPER}'
            FROM c WHERE j.id = c.id
            RETURNING {_FINISH_RETURNING}, c.owned_by""",
        params,
    )


def _after_reap(rows: list[tuple], message: str, **fields: Any) -> dict[int, Finished]:
    finished = _finished([r[:-1] for r in rows])
    owners = {r[0]: r[-1] for r in rows}
    for f in finished.values():
        # The lost lease's identity: the worker that held it and the version it held.
        log.warning(
            message,
            f.status,
            extra=job_log_fields(
                f.job_id,
                f.lease_version - 1,
                owners.get(f.job_id),
                f.queue,
                f.task,
                new_lease_version=f.lease_version,
                retry_count=f.retry_count,
                **fields,
            ),
        )
    signal_after_commit(
        [(f.job_id, f.queue) for f in finished.values() if f.status == Status.QUEUED],
        park_on_failure=False,
    )
    return finished


def reap_expired(lease_seconds: float, limit: int = 500) -> dict[int, Finished]:
    """Expired leases (no claim or heartbeat for `lease_seconds`) → queued with a
    retry spent and the lease bumped, or failed when the budget is spent.

    SKIP LOCKED keeps concurrent reapers from ever touching the same row.
    """
    rows = _reap(
        f"""c AS (
              SELECT id, owned_by FROM {T}
              WHERE {lifecycle.EXPIRE.where()}
                AND heartbeat_at < now() - %(lease)s * interval '1 second'
              ORDER BY heartbeat_at LIMIT %(limit)s
              FOR UPDATE SKIP LOCKED)""",
        "format('lease expired: no heartbeat from %%s for over %%s s', j.owned_by, %(lease)s)",
        {"lease": lease_seconds, "limit": limit},
    )
    finished = _after_reap(rows, f"lease expired: no heartbeat for over {lease_seconds}s; job %s")
    for f in finished.values():
        metrics.LEASE_EXPIRED.labels(f.queue).inc()
    return finished


# --- the worker registry ----------------------------------------------------------

W = WorkerProcess._meta.db_table
# Advisory lock namespace of worker sessions ('jobs'); the second key is the row's lock_key.
PRESENCE_LOCK_SPACE = 0x6A6F6273
# A registered worker whose advisory lock no session holds, and whose row has not
# been beaten for `grace` seconds: its process is gone (kill -9, OOM, host loss).
_GONE_WORKERS = f"""
  SELECT w.id FROM {W} w
  WHERE w.lock_key IS NOT NULL
    AND w.heartbeat_at < now() - %(grace)s * interval '1 second'
    AND NOT EXISTS (
      SELECT 1 FROM pg_locks l
      WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
        AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        AND l.classid = {PRESENCE_LOCK_SPACE}::oid AND l.objid = w.lock_key::oid)
"""


def presence_lock_key(worker_id: str) -> int:
    """The second key of the worker's advisory lock: non-negative, so it reads the same
    as pg_locks.objid. A collision only makes a dead worker look alive (the lease
    still recovers its jobs), never the reverse."""
    return zlib.crc32(worker_id.encode()) & 0x7FFFFFFF


def worker_beat(
    conn: psycopg.Connection,
    worker_id: str,
    *,
    hostname: str,
    pid: int,
    queues: Sequence[str],
    concurrency: int,
    lock: bool,
    locked: bool,
) -> bool:
    """Register or refresh `worker_id` on its own presence connection (autocommit).

    With `lock` and not yet `locked`, first try to take the session advisory lock
    that says the process lives; returns whether this session holds it.
    """
    key = presence_lock_key(worker_id) if lock else None
    with conn.cursor() as cur:
        if lock and not locked:
            cur.execute("SELECT pg_try_advisory_lock(%s, %s)", [PRESENCE_LOCK_SPACE, key])
            locked = bool(cur.fetchone()[0])
        cur.execute(
            f"""INSERT INTO {W} (id, hostname, pid, backend_pid, lock_key, queues, concurrency,
                                 started_at, heartbeat_at)
                VALUES (%s, %s, %s, pg_backend_pid(), %s, %s, %s, now(), now())
                ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(),
                    backend_pid = EXCLUDED.backend_pid, lock_key = EXCLUDED.lock_key,
                    queues = EXCLUDED.queues""",
            [worker_id, hostname, pid, key, list(queues), concurrency],
        )
    return locked


def worker_leave(conn: psycopg.Connection, worker_id: str) -> None:
    """A worker stopping on its own: its row goes (its lock goes with the session)."""
    with conn.cursor() as cur:
        cur.execute(f"DELETE FROM {W} WHERE id = %s", [worker_id])


def reap_gone_owners(grace_seconds: float, limit: int = 500) -> dict[int, Finished]:
    """Jobs of workers whose process is gone (session lock released, no beat for
    `grace_seconds`) → queued with a retry spent and the lease bumped, or failed when
    the budget is spent: a lease expiry found in seconds instead of a lease.

    A frozen worker keeps its session, so only its lease can expire; a worker whose
    connection was killed takes its lock again within a beat, before the grace ends.
    """
    rows = _reap(
        f"""gone AS ({_GONE_WORKERS}),
            c AS (
              SELECT j.id, j.owned_by FROM {T} j
              WHERE {lifecycle.EXPIRE.where("j.status")} AND j.owned_by IN (SELECT id FROM gone)
              ORDER BY j.id LIMIT %(limit)s
              FOR UPDATE OF j SKIP LOCKED)""",
        "format('worker gone: the session of %%s ended', j.owned_by)",
        {"grace": grace_seconds, "limit": limit},
    )
    return _after_reap(rows, "worker gone: its session ended; job %s")


_FORGET_WORKERS_SQL = f"""
DELETE FROM {W} w
WHERE (w.id IN ({_GONE_WORKERS})
       OR w.heartbeat_at < now() - %(stale)s * interval '1 second')
  AND NOT EXISTS (SELECT 1 FROM {T} j
                  WHERE j.status = '{Status.PROCESSING}' AND j.owned_by = w.id)
RETURNING w.id"""


def forget_workers(grace_seconds: float, stale_seconds: float) -> int:
    """Delete registry rows of gone workers, and rows not beaten for `stale_seconds`,
    once they own no processing job (a worker that comes back registers again)."""
    rows = _rows(
        _FORGET_WORKERS_SQL,
        {"grace": grace_seconds, "stale": stale_seconds},
    )
    for (worker_id,) in rows:
        log.info("worker gone: unregistered", extra={"worker_id": worker_id})
    return len(rows)


_OVER_BUDGET_SQL = f"""
WITH c AS (SELECT id FROM {T}
           WHERE {lifecycle.OVER_BUDGET.where()}
             AND retry_count > max_retries
           LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
UPDATE {T} j SET status = '{Status.FAILED}', finished_at = now(), result = NULL,
       error = format('retry budget exhausted (%%s retries > max %%s)',
                      j.retry_count, j.max_retries),
       updated_by = '{Role.REAPER}'
FROM c WHERE j.id = c.id RETURNING {_FINISH_RETURNING}"""


def fail_over_budget(limit: int = 500) -> dict[int, Finished]:
    """queued / enqueue_failed rows whose retry_count already exceeds the budget → failed."""
    rows = _rows(
        _OVER_BUDGET_SQL,
        {"limit": limit},
    )
    return _finished(rows)
