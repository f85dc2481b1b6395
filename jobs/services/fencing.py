"""The lease holder's writes: heartbeat, start marks, complete, fail, release.

Each carries the authority predicate of SPEC §3 (id, lease_version, owned_by, status =
'processing') per row of a batch, so a worker whose lease was taken over writes nothing,
and the rows returned say which landed; a rejected write is recorded with its reason.
A final write uses `statement_timestamp()`, so a transactional handler's job finishes
when its write is made, not when its transaction began.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from django.db import transaction

from jobs import lifecycle, metrics
from jobs.conf import settings
from jobs.lifecycle import Role, Status, actor_sql
from jobs.models import JobEvent
from jobs.services.common import (
    _FINISH_RETURNING,
    _RECOVERABLE,
    _UNOWN,
    Finished,
    Lease,
    T,
    _finished,
    _hot_rows,
    _rows,
    signal_after_commit,
)

log = logging.getLogger(__name__)


# The authority predicate of SPEC §3, per row of a batch. Statements also say
# `j.id = ANY(ids)` so the planner reaches the rows through the primary key.
_FENCE = (
    "j.id = f.id AND j.lease_version = f.lv AND j.owned_by = f.owner"
    f" AND j.status = '{Status.PROCESSING}' AND {lifecycle.hot_sql('j')}"
)
_HOLDER = actor_sql(Role.WORKER, "f.owner")
_BY_HOLDER = f"updated_by = {_HOLDER}"


def _fence_arrays(leases: Sequence[Lease]) -> tuple[list[int], list[int], list[str]]:
    return (
        [x.job_id for x in leases],
        [x.lease_version for x in leases],
        [x.worker_id for x in leases],
    )


_HEARTBEAT_SQL = f"""
UPDATE {T} j SET heartbeat_at = now(),
       progress = CASE WHEN f.progress IS NULL THEN j.progress
                       ELSE f.progress::jsonb || jsonb_build_object('updated_at', now()) END
FROM unnest(%(ids)s::bigint[], %(lvs)s::bigint[], %(owners)s::text[], %(progress)s::text[])
     AS f(id, lv, owner, progress)
WHERE j.id = ANY(%(ids)s::bigint[]) AND {_FENCE} AND {_RECOVERABLE}
RETURNING j.id, j.lease_version, j.queue, j.cancel_requested_at IS NOT NULL
"""


def _fence_params(leases: Sequence[Lease]) -> dict[str, list]:
    ids, lvs, owners = _fence_arrays(leases)
    return {"ids": ids, "lvs": lvs, "owners": owners}


class Held(frozenset):
    """The (job id, lease_version) of each lease a heartbeat extended, and among
    them `cancel_requested`: those whose job someone asked to cancel."""

    cancel_requested: frozenset[tuple[int, int]] = frozenset()


def heartbeat(
    leases: Sequence[Lease], progress: Sequence[dict[str, Any] | None] | None = None
) -> Held:
    """Extend the leases still held, in one statement; returns the (job id,
    lease_version) of each that held.

    A lease missing from the answer is lost: its worker must stop treating the
    job as its own. Keyed by lease, not job: a worker may hold a newer lease on a
    job whose older attempt (revoked, reaped) has not returned yet.
    `progress[i]`, when given and not None, is written for `leases[i]` under the
    same fence (stamped `updated_at` by the database), so a stale attempt's
    progress is refused like any of its writes.
    """
    if not leases:
        return Held()
    texts = [None if p is None else json.dumps(p) for p in (progress or [None] * len(leases))]
    rows = _hot_rows(_HEARTBEAT_SQL, {**_fence_params(leases), "progress": texts})
    per_queue: dict[str, int] = defaultdict(int)
    for row in rows:
        per_queue[row[2]] += 1
    for queue, n in per_queue.items():
        metrics.child(metrics.HEARTBEATS, queue).inc(n)
    return _held([(r[0], r[1], r[3]) for r in rows])


_MARK_STARTED_SQL = f"""
UPDATE {T} j SET heartbeat_at = now(),
       started_at = CASE WHEN j.cancel_requested_at IS NULL THEN statement_timestamp() END
FROM unnest(%(ids)s::bigint[], %(lvs)s::bigint[], %(owners)s::text[]) AS f(id, lv, owner)
WHERE j.id = ANY(%(ids)s::bigint[]) AND {_FENCE} AND {_RECOVERABLE}
RETURNING j.id, j.lease_version, j.cancel_requested_at IS NOT NULL
"""


_STILL_HELD_SQL = f"""
SELECT j.id, j.lease_version, j.cancel_requested_at IS NOT NULL
FROM {T} j JOIN unnest(%(ids)s::bigint[], %(lvs)s::bigint[], %(owners)s::text[])
     AS f(id, lv, owner) ON {_FENCE}
WHERE j.id = ANY(%(ids)s::bigint[])
"""


def _held(rows: list[tuple]) -> Held:
    held = Held((r[0], r[1]) for r in rows)
    held.cancel_requested = frozenset((r[0], r[1]) for r in rows if r[2])
    return held


def still_held(leases: Sequence[Lease]) -> Held:
    """Which leases still hold, and which of those have a cancel request: the fence of
    `heartbeat` read without writing (a worker's look at its prefetched jobs)."""
    return _held(_hot_rows(_STILL_HELD_SQL, _fence_params(leases))) if leases else Held()


def mark_started(leases: Sequence[Lease]) -> Held:
    """Mark attempts started before their handlers are called, fenced, in one statement
    for the batch; returns the leases still held, like `heartbeat` (with
    `cancel_requested`: not marked, they end cancelled unrun). A lease missing from
    the answer was revoked or reaped while its job waited in the worker's prefetch
    buffer: its handler must not be called."""
    if not leases:
        return Held()
    return _held(_hot_rows(_MARK_STARTED_SQL, _fence_params(leases)))


_COMPLETE_SQL = f"""
UPDATE {T} j SET status = '{Status.DONE}', result = f.result::jsonb, error = NULL,
       {_UNOWN}, finished_at = statement_timestamp(), {_BY_HOLDER}
FROM unnest(%(ids)s::bigint[], %(lvs)s::bigint[], %(owners)s::text[], %(results)s::text[])
     AS f(id, lv, owner, result)
WHERE j.id = ANY(%(ids)s::bigint[]) AND {_FENCE} RETURNING {_FINISH_RETURNING}
"""


def complete(items: Sequence[tuple[Lease, Any]]) -> dict[int, Finished]:
    """processing → done for each (lease, result) whose fence still holds.

    One statement for the whole batch; a lease missing from the answer lost
    its authority and its result was not written.
    """
    if not items:
        return {}
    ids, lvs, owners = _fence_arrays([lease for lease, _ in items])
    dumps = json.dumps
    results = [None if r is None else dumps(r) for _, r in items]
    rows = _hot_rows(_COMPLETE_SQL, {"ids": ids, "lvs": lvs, "owners": owners, "results": results})
    return _finished(rows)


_BACKOFF = (
    "now() + least(%(cap)s::float8, %(base)s::float8 * power(2, j.retry_count)) "
    "* (0.5 + random() / 2) * interval '1 second'"
)


_RETRY = "NOT f.permanent AND j.retry_count + 1 <= j.max_retries"
_FAIL_SQL = f"""
UPDATE {T} j SET
       retry_count = j.retry_count + CASE WHEN f.permanent THEN 0 ELSE 1 END,
       error = f.error, error_class = f.error_class, error_traceback = f.traceback,
       result = NULL,
       status = CASE WHEN {_RETRY} THEN '{Status.QUEUED}' ELSE '{Status.FAILED}' END,
       lease_version = j.lease_version + CASE WHEN {_RETRY} THEN 1 ELSE 0 END,
       run_at = CASE WHEN NOT {_RETRY} THEN j.run_at
                WHEN f.policy_delay IS NOT NULL  -- the task's own backoff (jobs.retries)
                THEN now() + greatest(f.policy_delay, COALESCE(f.delay, 0)) * interval '1 second'
                ELSE greatest({_BACKOFF}, now() + COALESCE(f.delay, 0) * interval '1 second')
                END,
       finished_at = CASE WHEN {_RETRY} THEN NULL ELSE statement_timestamp() END,
       {_UNOWN}, {_BY_HOLDER}
FROM unnest(%(ids)s::bigint[], %(lvs)s::bigint[], %(owners)s::text[],
            %(errors)s::text[], %(permanent)s::boolean[], %(classes)s::text[],
            %(tracebacks)s::text[], %(delays)s::float8[], %(policy_delays)s::float8[])
     AS f(id, lv, owner, error, permanent, error_class, traceback, delay, policy_delay)
WHERE j.id = ANY(%(ids)s::bigint[]) AND {_FENCE}
RETURNING {_FINISH_RETURNING}, j.run_at <= now()
"""
# A task's retry policy's decision, beside the transition it caused: the delay as run_at
# holds it (a Retry-After may have made it longer) and the policy's reason.
_RETRY_DECISIONS_SQL = f"""
INSERT INTO jobs_jobevent (job_id, kind, at, from_status, to_status, actor,
                          lease_version, retry_count, job_created_at, error)
SELECT j.id, '{JobEvent.RETRY_POLICY}', now(), '{Status.PROCESSING}', j.status, {_HOLDER},
       j.lease_version, j.retry_count, j.created_at,
       CASE WHEN j.status = '{Status.QUEUED}'
            THEN format('%%s; run_at in %%ss', f.reason,
                        round(extract(epoch FROM j.run_at - now())::numeric, 3))
            WHEN f.reason LIKE 'retry %%'
            THEN format('no retry: the budget of %%s retries is spent', j.max_retries)
            ELSE f.reason END
FROM unnest(%s::bigint[], %s::text[], %s::text[]) AS f(id, owner, reason)
JOIN {T} j ON j.id = f.id
"""


def fail(items: Sequence[tuple]) -> dict[int, Finished]:
    """A failed attempt for each (lease, error, permanent[, error_class, traceback,
    retry_after, policy_delay, policy_reason]),
    fenced (SPEC §4). The class and traceback go to the row in the same statement,
    and the history trigger copies them into the event that ends the attempt.

    Retryable with budget left: retry_count + 1 and back to queued with the
    lease bumped and run_at pushed back by exponential backoff with jitter, or
    by `retry_after` seconds when that is later (a receiver's Retry-After).
    Budget spent (retry_count > max_retries): failed. Permanent: failed at
    once, retry_count unchanged (no retry was spent). Retries are re-signalled
    after commit when due; backed-off ones are found by polling and the reaper.
    A task's retry policy (jobs.retries) gives `policy_delay` instead of the global
    backoff and a reason, written to the history with the transition.
    """
    if not items:
        return {}
    if any(len(item) > 7 and item[7] for item in items):
        with transaction.atomic():  # the decisions' history rows with their transitions
            return _fail(items)
    return _fail(items)


def _fail(items: Sequence[tuple]) -> dict[int, Finished]:
    ids, lvs, owners = _fence_arrays([item[0] for item in items])
    rows = _hot_rows(
        _FAIL_SQL,
        {
            "ids": ids,
            "lvs": lvs,
            "owners": owners,
            "errors": [item[1] for item in items],
            "permanent": [item[2] for item in items],
            "classes": [item[3] if len(item) > 3 else None for item in items],
            "tracebacks": [item[4] if len(item) > 4 else None for item in items],
            "delays": [item[5] if len(item) > 5 else None for item in items],
            "policy_delays": [item[6] if len(item) > 6 else None for item in items],
            "base": float(settings.JOBS_RETRY_BACKOFF_BASE),
            "cap": float(settings.JOBS_RETRY_BACKOFF_MAX),
        },
    )
    finished = _finished([r[:-1] for r in rows])
    decided = [item for item in items if len(item) > 7 and item[7] and item[0].job_id in finished]
    if decided:
        _rows(
            _RETRY_DECISIONS_SQL,
            [
                [item[0].job_id for item in decided],
                [item[0].worker_id for item in decided],
                [item[7] for item in decided],
            ],
        )
    for f in finished.values():
        if f.status == Status.QUEUED:
            metrics.child(metrics.RETRIED, f.queue, f.task).inc()
    signal_after_commit(
        [(r[0], r[2]) for r in rows if r[1] == Status.QUEUED and r[-1]], park_on_failure=False
    )
    return finished


_RELEASE_SQL = f"""
UPDATE {T} j SET status = '{Status.QUEUED}', lease_version = j.lease_version + 1,
       run_at = {{run_at}}, error = %(reason)s::text, {_UNOWN}, {_BY_HOLDER}
FROM unnest(%(ids)s::bigint[], %(lvs)s::bigint[], %(owners)s::text[]) AS f(id, lv, owner)
WHERE j.id = ANY(%(ids)s::bigint[]) AND {_FENCE} RETURNING j.id, j.queue, j.status
"""
_RELEASE_RUN_SQL = _RELEASE_SQL.replace("{run_at}", "now()")
# A job that never started keeps its run_at, so it keeps its place in the claim order.
_RELEASE_UNSTARTED_SQL = _RELEASE_SQL.replace("{run_at}", "j.run_at")


def release(
    leases: Sequence[Lease],
    reason: str = "released by worker shutdown",
    *,
    unstarted: bool = False,
) -> set[int]:
    """processing → queued without spending a retry (graceful shutdown), fenced.

    The lease is bumped so that the releasing worker can no longer write.
    `unstarted`: the handler never ran (a prefetched job), so the job keeps its
    place in the queue instead of going behind the jobs due meanwhile.
    """
    if not leases:
        return set()
    sql = _RELEASE_UNSTARTED_SQL if unstarted else _RELEASE_RUN_SQL
    rows = _hot_rows(sql, {"reason": reason, **_fence_params(leases)})
    # A job with a cancel request pending ended failed instead (lifecycle): no signal.
    signal_after_commit([r[:2] for r in rows if r[2] == Status.QUEUED], park_on_failure=False)
    return {r[0] for r in rows}


_FENCE_REJECTED_SQL = f"""
INSERT INTO jobs_jobevent (job_id, kind, at, from_status, to_status, actor,
                          lease_version, retry_count, job_created_at, error)
SELECT j.id, 'fence_rejected', now(), j.status, j.status, {_HOLDER},
       f.lv, j.retry_count, j.created_at,
       format('stale %%s rejected: held lease %%s, row is at lease %%s '
              '(%%s, owner %%s)', %s::text, f.lv, j.lease_version, j.status,
              coalesce(j.owned_by, '-'))
FROM unnest(%s::bigint[], %s::bigint[], %s::text[]) AS f(id, lv, owner)
JOIN {T} j ON j.id = f.id
RETURNING job_id, (SELECT lease_version FROM {T} WHERE id = job_id)"""


def record_fence_rejections(leases: Sequence[Lease], op: str) -> None:
    """Count, log and record stale writes that the fence turned away (SPEC §3)."""
    if not leases:
        return
    ids, lvs, owners = _fence_arrays(leases)
    rows = _rows(
        _FENCE_REJECTED_SQL,
        [op, ids, lvs, owners],
    )
    current = dict(rows)
    for lease in leases:
        metrics.FENCE_REJECTIONS.labels(lease.queue, lease.task, op).inc()
        log.warning(
            "fence rejected stale %s: held lease_version %s, row now at %s",
            op,
            lease.lease_version,
            current.get(lease.job_id),
            extra=lease.log_fields(current_lease_version=current.get(lease.job_id)),
        )
