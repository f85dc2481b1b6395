"""The plain claim, queued → processing: an open queue's due rows in PostgreSQL's claim
order (priority DESC, run_at, id), or the given ids (a Redis hint). FOR UPDATE SKIP
LOCKED lets many workers claim at once without waiting on each other. The claim's
UPDATE and the rows it returns (`_CLAIM_SET`, `_leases`) are shared with the other two
ways; a queue with controls is never claimed here, whatever a worker's view of it says.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from jobs import lifecycle, metrics
from jobs.lifecycle import NOT_STARTED, Role, Status, actor_sql
from jobs.models import Queue
from jobs.services.common import Lease, T, _hot_rows

# The claim's `updated_by` (`worker:<id>`), made by the statement from the worker's id
# (typed as `owned_by`, its other use): the actor is not built in Python for every claim.
CLAIMER = actor_sql(Role.WORKER, "%(worker)s::varchar")

# The claimed rows come back in claim order, so a batch starts best-first too. The
# `start` best of them (all when NULL) go straight to idle handler threads and are
# marked started here; the others by `mark_started` when a thread takes them (D77).
_CLAIM_SET = f"""
, u AS (
UPDATE {T} j SET status = '{Status.PROCESSING}', lease_version = j.lease_version + 1,
       owned_by = %(worker)s, claimed_at = now(), heartbeat_at = now(),
       started_at = CASE WHEN j.id = ANY(ARRAY(SELECT id FROM c LIMIT %(start)s))
                    THEN statement_timestamp() END,
       updated_by = {CLAIMER}
WHERE j.id = ANY(ARRAY(SELECT id FROM c)) AND {lifecycle.hot_sql("j")}
RETURNING j.id, j.lease_version, j.task, j.payload, j.queue, j.retry_count,
          j.max_retries, j.created_at, j.priority, j.run_at,
          coalesce(j.error LIKE '%%{NOT_STARTED}', false) AS rerun, j.timeout
)
SELECT id, lease_version, task, payload, queue, retry_count, max_retries, created_at,
       priority, rerun, timeout
FROM u ORDER BY priority DESC, run_at, id
"""
QT = Queue._meta.db_table
# An open queue: no row in jobs_queue says paused or limited. Uncorrelated, so one
# primary-key probe per statement (an InitPlan), evaluated before any job row is read.
_LIMITED = (
    "q.concurrency IS NOT NULL OR q.rate_limit IS NOT NULL OR q.key_concurrency IS NOT NULL"
    " OR q.key_rate_limit IS NOT NULL"
)
_CONTROLLED = f"(q.paused OR q.fair OR {_LIMITED})"
_QUEUE_OPEN = f"NOT EXISTS (SELECT FROM {QT} q WHERE q.name = %(queue)s AND {_CONTROLLED})"


def _claim_queue_sql(also: str = "") -> str:
    return f"""
WITH c AS (
  SELECT id FROM {T}
  WHERE {lifecycle.CLAIM.where()} AND queue = %(queue)s AND run_at <= now(){also}
  ORDER BY priority DESC, run_at, id
  LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED
)
{_CLAIM_SET}
"""


# The claim of an open queue. A queue with controls is claimed by claim_limited only,
# so a worker that still thinks it open (its snapshot is a second old) claims nothing.
_CLAIM_NEXT_SQL = _claim_queue_sql(f"\n    AND {_QUEUE_OPEN}")


_CLAIM_IDS_SQL = f"""
WITH c AS (
  SELECT id FROM {T}
  WHERE id = ANY(%(ids)s) AND {lifecycle.CLAIM.where()} AND run_at <= now()
    AND NOT EXISTS (SELECT FROM {QT} q WHERE q.name = {T}.queue AND {_CONTROLLED})
  ORDER BY priority DESC, run_at, id
  FOR UPDATE SKIP LOCKED
)
{_CLAIM_SET}
"""


def _leases(rows: list[tuple], worker_id: str) -> list[Lease]:
    leases = []
    per_queue: dict[str, int] = defaultdict(int)
    for r in rows:  # read in binary (_hot_rows): the payload arrives parsed, a string too
        leases.append(
            Lease(r[0], r[1], worker_id, r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10])
        )
        per_queue[r[4]] += 1
    for queue, n in per_queue.items():
        metrics.child(metrics.CLAIMED, queue).inc(n)
    return leases


def claim_next(
    worker_id: str, queues: Sequence[str], limit: int, *, start: int | None = None
) -> list[Lease]:
    """queued → processing for up to `limit` due jobs, in the order `queues` are given,
    each queue in PostgreSQL's claim order (priority DESC, run_at, id). The first
    `start` of them (all when None) have their handlers called now: their attempts
    are marked started (D77).

    FOR UPDATE SKIP LOCKED lets many workers claim at once without waiting on
    each other; the partial index job_claim_idx serves the scan.
    """
    leases: list[Lease] = []
    for queue in queues:
        if len(leases) >= limit:
            break
        rows = _hot_rows(
            _CLAIM_NEXT_SQL,
            {
                "queue": queue,
                "limit": limit - len(leases),
                "worker": worker_id,
                "start": None if start is None else max(0, start - len(leases)),
            },
        )
        leases.extend(_leases(rows, worker_id))
    return leases


def claim_ids(worker_id: str, job_ids: Sequence[int], *, start: int | None = None) -> list[Lease]:
    """queued → processing for the given ids that are still claimable.

    An id not returned was a duplicate delivery (already claimed, finished,
    not yet due, or being claimed by someone else right now). Jobs of a queue
    with controls are never claimed by id (claim_limited_under_queue_lock is
    their only claim).
    """
    if not job_ids:
        return []
    rows = _hot_rows(
        _CLAIM_IDS_SQL,
        {
            "ids": list(job_ids),
            "worker": worker_id,
            "start": start,
        },
    )
    return _leases(rows, worker_id)


def claim(worker_id: str, job_id: int) -> Lease | None:
    leases = claim_ids(worker_id, [job_id])
    return leases[0] if leases else None
