"""Staff repairs and callers' controls: retry a failed job, repair a job whose Redis push
failed, revoke, cancel (at once while queued, by request while running), and deactivate
API clients. Each is one compare-and-set whose history row names the actor; a retry
never makes two live holders of a unique key (D58).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

from django.db import IntegrityError, transaction

from jobs import clientcache, lifecycle, metrics
from jobs.lifecycle import CANCELLED, NON_TERMINAL, Role, Status, actor_role
from jobs.logconfig import job_log_fields
from jobs.models import Client, JobEvent
from jobs.services.common import (
    _FINISH_RETURNING,
    _UNOWN,
    T,
    _count_on_commit,
    _finished,
    _rows,
    moved_retry,
    signal_after_commit,
)

log = logging.getLogger(__name__)


# A failed job whose unique_key another live job holds stays failed (the key is
# taken), and of several chosen jobs sharing a free key only the oldest is retried:
# a retry never makes two live holders of a key (D58).
_STAFF_RETRY_SQL = f"""
UPDATE {T} j SET status = '{Status.QUEUED}', retry_count = 0, result = NULL,
       finished_at = NULL, run_at = now(), due_at = now(),
       cancel_requested_at = NULL, updated_by = %(actor)s, period = {lifecycle.HOT_PERIOD}
WHERE id = ANY(%(ids)s) AND {lifecycle.STAFF_RETRY.where()}
  AND (j.unique_key IS NULL OR (
    NOT EXISTS (SELECT 1 FROM {T} h
                WHERE {lifecycle.hot_sql("h")} AND h.client_id IS NOT DISTINCT FROM j.client_id
                  AND h.unique_key = j.unique_key
                  AND h.status IN ({lifecycle.sql_list(NON_TERMINAL)}))
    AND j.id = (SELECT min(o.id) FROM {T} o
                WHERE o.id = ANY(%(ids)s) AND o.status = '{Status.FAILED}'
                  AND o.client_id IS NOT DISTINCT FROM j.client_id
                  AND o.unique_key = j.unique_key)))
RETURNING id, queue"""


def staff_retry(job_ids: Sequence[int], actor: str) -> list[int]:
    """failed → queued, retry budget reset (SPEC §2: staff only, audited).

    The job is due again now: the SLO clock (`due_at`) restarts at the retry. An
    earlier cancel request is forgotten: the retry is a new decision to run it.
    A job whose unique_key a live job holds is left failed (not in the result); a
    holder submitted while this statement runs makes it retry nothing rather than
    fail with the index's violation.
    """
    try:
        rows = moved_retry(partial(_rows, _STAFF_RETRY_SQL, {"actor": actor, "ids": list(job_ids)}))
    except IntegrityError as exc:
        if "job_unique_key_live" not in str(exc):
            raise
        log.warning("staff retry raced a submission for a unique key; nothing retried")
        rows = []
    _count_on_commit(metrics.STAFF_ACTIONS.labels("retry"), len(rows))
    signal_after_commit(rows, park_on_failure=False)
    return [r[0] for r in rows]


_REPAIR_SQL = f"""
WITH c AS (SELECT id FROM {T} WHERE {lifecycle.REPAIR.where()} {{ids_clause}}
           ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
UPDATE {T} j SET status = '{Status.QUEUED}', updated_by = %(actor)s
FROM c WHERE j.id = c.id RETURNING j.id, j.queue"""


def repair_enqueue_failed(
    limit: int = 500, job_ids: Sequence[int] | None = None, actor: str = Role.REAPER.value
) -> list[int]:
    """enqueue_failed → queued, re-signalled after commit."""
    ids_clause = "AND id = ANY(%(ids)s)" if job_ids is not None else ""
    rows = _rows(
        _REPAIR_SQL.replace("{ids_clause}", ids_clause),
        {"ids": list(job_ids or []), "limit": limit, "actor": actor},
    )
    signal_after_commit(rows, park_on_failure=False)
    return [r[0] for r in rows]


def staff_repair(job_ids: Sequence[int], actor: str) -> list[int]:
    repaired = repair_enqueue_failed(limit=len(job_ids) or 1, job_ids=job_ids, actor=actor)
    _count_on_commit(metrics.STAFF_ACTIONS.labels("repair"), len(repaired))
    return repaired


_REVOKE_SQL = f"""
UPDATE {T} j SET status = '{Status.QUEUED}', lease_version = j.lease_version + 1,
       run_at = now(), error = 'lease revoked by ' || %s, {_UNOWN},
       updated_by = %s
WHERE id = ANY(%s) AND {lifecycle.REVOKE.where()} RETURNING id, queue, status"""


def revoke(job_ids: Sequence[int], actor: str) -> list[int]:
    """processing → queued with the lease bumped and the owner cleared, so the
    running worker's late write is rejected by the fence. No retry is spent."""
    rows = _rows(
        _REVOKE_SQL,
        [actor, actor, list(job_ids)],
    )
    _count_on_commit(metrics.STAFF_ACTIONS.labels("revoke"), len(rows))
    signal_after_commit([r[:2] for r in rows if r[2] == Status.QUEUED], park_on_failure=False)
    return [r[0] for r in rows]


_CANCEL_SQL = f"""
UPDATE {T} j SET status = '{Status.FAILED}', error = %(error)s, finished_at = now(),
       result = NULL, updated_by = %(actor)s
WHERE id = ANY(%(ids)s) AND {lifecycle.CANCEL.where()}
      {{client_clause}}
RETURNING {_FINISH_RETURNING}"""


def cancel(
    job_ids: Sequence[int], actor: str, client_id: int | None = None, error: str = CANCELLED
) -> list[int]:
    """queued / enqueue_failed → failed with error "cancelled" (or `error`, which
    says why the job never ran): only jobs not started.

    With `client_id`, only that client's jobs are touched.
    """
    client_clause = "AND client_id = %(client)s" if client_id is not None else ""
    rows = _rows(
        _CANCEL_SQL.replace("{client_clause}", client_clause),
        {"actor": actor, "ids": list(job_ids), "client": client_id, "error": error},
    )
    if actor_role(actor) == Role.STAFF:
        _count_on_commit(metrics.STAFF_ACTIONS.labels("cancel"), len(rows))
    return list(_finished(rows))


_REQUEST_CANCEL_SQL = f"""
WITH u AS (
  UPDATE {T} j SET
         status = CASE WHEN j.status = '{Status.PROCESSING}' THEN j.status
                       ELSE '{Status.FAILED}' END,
         error = CASE WHEN j.status = '{Status.PROCESSING}' THEN j.error ELSE '{CANCELLED}' END,
         result = CASE WHEN j.status = '{Status.PROCESSING}' THEN j.result END,
         finished_at = CASE WHEN j.status = '{Status.PROCESSING}' THEN NULL ELSE now() END,
         cancel_requested_at = CASE WHEN j.status = '{Status.PROCESSING}'
                                    THEN coalesce(j.cancel_requested_at, now())
                                    ELSE j.cancel_requested_at END,
         updated_by = %(actor)s
  WHERE id = ANY(%(ids)s) AND {lifecycle.REQUEST_CANCEL.where()}
        {{client_clause}}
  RETURNING {_FINISH_RETURNING}),
ev AS (
  INSERT INTO {JobEvent._meta.db_table}
    (job_id, kind, at, from_status, to_status, actor, lease_version, retry_count,
     job_created_at, error)
  SELECT u.id, '{JobEvent.CANCEL_REQUESTED}', now(), u.status, u.status, %(actor)s,
         u.lease_version, u.retry_count,
         (SELECT c.created_at FROM {T} c WHERE c.id = u.id AND c.period = 'infinity'),
         'cancel requested by ' || %(actor)s
  FROM u WHERE u.status = '{Status.PROCESSING}')
SELECT * FROM u
"""


def request_cancel(
    job_ids: Sequence[int], actor: str, client_id: int | None = None
) -> dict[int, str]:
    """Cancel jobs whatever stage they are at before the end, in one statement.

    queued / enqueue_failed → failed "cancelled" (as `cancel`); processing → a cancel
    request is recorded (`cancel_requested_at`, kept if already set, and a history
    event): the worker stops the handler at its next heartbeat, and any requeue ends
    the job instead (lifecycle). Returns {job id: "cancelled" | "requested"}; finished
    jobs are absent. One statement, so a job moving between queued and processing
    meanwhile is still caught in whichever state the row lock finds it.
    """
    client_clause = "AND client_id = %(client)s" if client_id is not None else ""
    rows = _rows(
        _REQUEST_CANCEL_SQL.replace("{client_clause}", client_clause),
        {"actor": actor, "ids": list(job_ids), "client": client_id},
    )
    _finished([r for r in rows if r[1] == Status.FAILED])
    out = {r[0]: ("requested" if r[1] == Status.PROCESSING else "cancelled") for r in rows}
    for r in rows:
        if r[1] == Status.PROCESSING:
            log.info(
                "cancel requested by %s",
                actor,
                extra=job_log_fields(r[0], r[5], None, r[2], r[3]),
            )
    return out


def staff_cancel_running(job_ids: Sequence[int], actor: str) -> list[int]:
    """Staff "cancel running": a cancel request for each processing job (audited)."""
    done = request_cancel(job_ids, actor)
    _count_on_commit(metrics.STAFF_ACTIONS.labels("cancel_running"), len(done))
    return list(done)


def deactivate_clients(client_ids: Sequence[int]) -> list[int]:
    """Deactivate these API clients; the ids that were active. Their tokens stop working
    at once in every process: the client cache is told before the change commits."""
    with transaction.atomic():
        rows = list(
            Client.objects.select_for_update()
            .filter(pk__in=client_ids, is_active=True)
            .values_list("pk", "token_hash")
        )
        clientcache.forget(h for _, h in rows)
        Client.objects.filter(pk__in=[pk for pk, _ in rows]).update(is_active=False)
    return [pk for pk, _ in rows]
