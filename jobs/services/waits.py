"""Durable jobs' writes (jobs.durable): a step's checkpoint, a park to wait for a time or
a signal, a run continued as new (D315), and a signal's delivery. A checkpoint and a
park are fenced by the lease like a completion; a signal locks the job's row first, as
a park does, so whichever of the two commits first the other sees (no lost wake-up).
"""

from __future__ import annotations

from datetime import datetime

from django.db import transaction

from jobs import admission, lifecycle, metrics
from jobs.conf import settings
from jobs.lifecycle import BLOCKED_RUN_AT, TERMINAL, Role, Status, WaitReason, actor_sql
from jobs.models import JobSignal, JobStep
from jobs.services.common import (
    _FINISH_RETURNING,
    _UNOWN,
    HOT,
    Lease,
    T,
    _count_on_commit,
    _finished,
    _hot_rows,
    _rows,
    signal_after_commit,
    worker_actor,
)

_STEP = JobStep._meta.db_table
_SIGNAL = JobSignal._meta.db_table
_HOLDER_PARAM = actor_sql(Role.WORKER, "%(owner)s")
# The fence of SPEC §3 for one lease given as parameters.
_FENCE_ONE = (
    "j.id = %(id)s AND j.lease_version = %(lv)s AND j.owned_by = %(owner)s"
    f" AND j.status = '{Status.PROCESSING}' AND {lifecycle.hot_sql('j')}"
)

# A checkpoint lands only while the lease holds: the fence read FOR SHARE and the
# INSERT are one statement, like a fenced completion. The share lock holds off every
# write of the row (a requeue, a revoke) until the step commits, and no row version,
# trigger call or WAL of the wide job row is written per step (D320); the heartbeat
# keeps the lease. It reads the hot partition by name, without a CTE: a plan PostgreSQL
# keeps, where one over jobs_job was planned again per step (D371). Its commit waits
# for the WAL flush: a checkpoint the job's end may not outlive (D370).
_STEP_SQL = f"""
INSERT INTO {_STEP} (job_id, name, result, lease_version, worker_id, created_at)
SELECT j.id, %(name)s, %(result)s::jsonb, j.lease_version, j.owned_by, statement_timestamp()
FROM {HOT} j WHERE {_FENCE_ONE} FOR SHARE
ON CONFLICT (job_id, name) DO NOTHING
RETURNING id"""
# No row inserted: the fence refused it, or the step was stored already (then the
# answer is the fence's).
_STEP_FENCE_SQL = f"SELECT 1 FROM {HOT} j WHERE {_FENCE_ONE}"


def checkpoint_step(lease: Lease, name: str, result_json: str) -> bool:
    """Store a step's result under the lease's fence; False when the fence refused it
    (the lease is stale: the step's effects were not recorded)."""
    params = {
        "id": lease.job_id,
        "lv": lease.lease_version,
        "owner": lease.worker_id,
        "name": name,
        "result": result_json,
    }
    if _hot_rows(_STEP_SQL, params):
        return True
    return bool(_hot_rows(_STEP_FENCE_SQL, params))


# Park: processing → queued, lease bumped (the parking worker can no longer write), no
# retry spent, due again at the wake-up or timeout; with a wait checkpoint if given.
_SUSPEND_SQL = f"""
WITH f AS (
  UPDATE {T} j SET status = '{Status.QUEUED}', lease_version = j.lease_version + 1,
         run_at = greatest(now(), coalesce(%(until)s::timestamptz,
                                           now() + %(seconds)s * interval '1 second')),
         due_at = greatest(now(), coalesce(%(until)s::timestamptz,
                                           now() + %(seconds)s * interval '1 second')),
         wait_reason = %(reason)s, wait_key = %(key)s, {_UNOWN},
         updated_by = {_HOLDER_PARAM}
  WHERE j.id = %(id)s AND j.lease_version = %(lv)s AND j.owned_by = %(owner)s
    AND {lifecycle.SUSPEND.where("j.status")}
  RETURNING j.id, j.queue, j.status, j.run_at),
cp AS (
  INSERT INTO {_STEP} (job_id, name, result, lease_version, worker_id, created_at)
  SELECT f.id, %(name)s::text,
         jsonb_build_object('until', CASE WHEN f.run_at >= %(blocked)s::timestamptz THEN NULL
                                          ELSE f.run_at END),
         %(lv)s, %(owner)s, statement_timestamp()
  FROM f WHERE %(name)s::text IS NOT NULL
  ON CONFLICT (job_id, name) DO NOTHING)
SELECT id, queue, status, run_at <= now() FROM f"""

# A signal committed while the job was parking (the signal's transaction found it
# still processing): the park, holding the row lock, sees it in a new statement.
_WAKE_IF_SIGNALLED_SQL = f"""
UPDATE {T} j SET run_at = now(), due_at = now(), wait_reason = NULL, wait_key = NULL
WHERE j.id = %(id)s AND {lifecycle.WAKE.where("j.status")}
  AND j.wait_reason = '{WaitReason.SIGNAL}'
  AND EXISTS (SELECT 1 FROM {_SIGNAL} s WHERE s.job_id = j.id AND s.key = j.wait_key)
RETURNING j.id, j.queue"""


def suspend(
    lease: Lease,
    *,
    reason: WaitReason,
    key: str | None = None,
    seconds: float | None = None,
    until: datetime | str | None = None,
    checkpoint: str | None = None,
) -> str | None:
    """Park a durable job (fenced): back to queued with the lease bumped and no retry
    spent, due at `until` or in `seconds`. Returns the status it took (queued, or
    failed when a cancel was pending), None when the fence refused it."""
    with transaction.atomic(durable=True):
        rows = _rows(
            _SUSPEND_SQL,
            {
                "id": lease.job_id,
                "lv": lease.lease_version,
                "owner": lease.worker_id,
                "until": until,
                "seconds": seconds,
                "reason": reason.value,
                "key": key,
                "name": checkpoint,
                "blocked": BLOCKED_RUN_AT,
            },
        )
        if not rows:
            return None
        job_id, queue, status, due = rows[0]
        if reason == WaitReason.SIGNAL and status == Status.QUEUED and not due:
            due = bool(_rows(_WAKE_IF_SIGNALLED_SQL, {"id": job_id}))
        if status == Status.QUEUED:
            metrics.child(metrics.PARKED, reason.value).inc()
        if due:
            signal_after_commit([(job_id, queue)], park_on_failure=False)
        if status != Status.QUEUED:
            _finished(_rows(f"SELECT {_FINISH_RETURNING} FROM {T} j WHERE j.id = %s", [job_id]))
    return status


# Continue-as-new (D315): the run ends done with a link to its next run, a new job
# with the same task and options, an empty history and the given payload. One
# transaction: neither run exists alone outside it, both never live together.
_CONTINUE_SQL = f"""
UPDATE {T} j SET status = '{Status.DONE}', error = NULL, {_UNOWN},
       result = jsonb_build_object('continued_as_new', n.id), next_run_id = n.id,
       chain_id = coalesce(j.chain_id, j.id), run_number = coalesce(j.run_number, 1),
       finished_at = statement_timestamp(),
       updated_by = {_HOLDER_PARAM}
FROM (SELECT nextval(pg_get_serial_sequence('{T}', 'id')) AS id) n
WHERE j.id = %(id)s AND j.lease_version = %(lv)s AND j.owned_by = %(owner)s
  AND {lifecycle.CONTINUE_AS_NEW.where("j.status")} AND {lifecycle.hot_sql("j")}
  AND j.cancel_requested_at IS NULL
RETURNING n.id, j.chain_id, j.run_number, j.previous_run_ids, j.priority,
          j.max_retries, j.client_id, j.unique_key, j.concurrency_key, j.timeout,
          j.payload::text, {_FINISH_RETURNING}"""
_NEXT_RUN_SQL = f"""
INSERT INTO {T} (id, task, payload, queue, priority, run_at, max_retries, client_id,
                 updated_by, unique_key, concurrency_key, timeout, status, retry_count,
                 lease_version, chain_id, run_number, previous_run_ids)
VALUES (%(id)s, %(task)s, %(payload)s::jsonb, %(queue)s, %(priority)s, now(), %(max_retries)s,
        %(client)s, %(actor)s, %(unique_key)s, %(ckey)s, %(timeout)s, '{Status.QUEUED}', 0, 0,
        %(chain)s, %(run)s, %(previous)s)"""
# A signal the ended run had not consumed goes to the next run. A separate statement
# after the fenced UPDATE: a signal whose transaction held the row lock has committed
# by then and is seen (deliver_signal locks the row first, D316).
_MOVE_SIGNALS_SQL = f"""
UPDATE {_SIGNAL} s SET job_id = %(next)s
WHERE s.job_id = %(old)s
  AND NOT EXISTS (SELECT 1 FROM {_STEP} st
                  WHERE st.job_id = %(old)s AND st.name = '~signal:' || s.key)"""


def continue_as_new(lease: Lease, payload_json: str | None) -> int | None:
    """End the lease's run (done, fenced) and create its next run, queued now with
    `payload_json` (None: the run's own payload). Returns the next run's id, or None
    when the fence refused it or a cancel is pending (nothing written)."""
    with transaction.atomic(durable=True):
        params = {"id": lease.job_id, "lv": lease.lease_version, "owner": lease.worker_id}
        rows = _rows(_CONTINUE_SQL, params)
        if not rows:
            return None
        next_id, chain, run, previous, priority, max_retries, client = rows[0][:7]
        unique_key, ckey, timeout, own_payload = rows[0][7:11]
        old = rows[0][11:]
        kept = int(settings.JOBS_CHAIN_IDS_KEPT)
        _rows(
            _NEXT_RUN_SQL,
            {
                "id": next_id,
                "task": old[3],
                "payload": own_payload if payload_json is None else payload_json,
                "queue": old[2],
                "priority": priority,
                "max_retries": max_retries,
                "client": client,
                "actor": worker_actor(lease.worker_id),
                "unique_key": unique_key,
                "ckey": ckey,
                "timeout": timeout,
                "chain": chain,
                "run": run + 1,
                "previous": ([*(previous or []), lease.job_id])[-kept:] if kept > 0 else None,
            },
        )
        _rows(_MOVE_SIGNALS_SQL, {"next": next_id, "old": lease.job_id})
        _finished([old])
        _count_on_commit(metrics.CONTINUED, 1)
        signal_after_commit([(next_id, old[2])], park_on_failure=True)
    return next_id


class SignalRefused(Exception):
    """A signal the job cannot take: `reason` is "not_found", "finished", "not_waiting"
    (parked waiting for another key) or "duplicate"."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_SIGNAL_LOCK_SQL = (
    f"SELECT status, client_id, wait_reason, wait_key, next_run_id FROM {T}"
    " WHERE id = %s FOR UPDATE"
)
_MAX_HOPS = 10_000  # runs a signal follows forward (a chain's links never loop)


def _signal_target(job_id: int, client_id: int | None) -> tuple[int, tuple]:
    """The run a signal for `job_id` goes to, locked: the job, or for a run that
    continued as new, the chain's live run (followed by its links, D316)."""
    for _ in range(_MAX_HOPS):
        rows = _rows(_SIGNAL_LOCK_SQL, [job_id])
        if not rows or (client_id is not None and rows[0][1] != client_id):
            raise SignalRefused("not_found", "Not found.")
        if rows[0][0] not in TERMINAL or rows[0][4] is None:
            return job_id, rows[0]
        job_id = rows[0][4]
    raise SignalRefused("not_found", "Not found.")


_SIGNAL_INSERT_SQL = f"""
INSERT INTO {_SIGNAL} (job_id, key, payload, sent_by, created_at)
VALUES (%(id)s, %(key)s, %(payload)s::jsonb, %(actor)s, now())
ON CONFLICT (job_id, key) DO NOTHING RETURNING id"""
_SIGNAL_WAKE_SQL = f"""
UPDATE {T} j SET run_at = now(), due_at = now(), wait_reason = NULL, wait_key = NULL,
       updated_by = %(actor)s
WHERE j.id = %(id)s AND {lifecycle.WAKE.where("j.status")}
  AND j.wait_reason = '{WaitReason.SIGNAL}' AND j.wait_key = %(key)s
RETURNING j.id, j.queue"""


def deliver_signal(
    job_id: int, key: str, payload_json: str, *, actor: str, client_id: int | None = None
) -> bool:
    """Store a signal for a job and, if it is parked waiting for `key`, make it due now.
    Returns True when it woke the job, False when the signal is kept for a later wait.

    The job's row is locked first, as a park locks it: whichever of the two commits
    first, the other sees it (no lost wake-up). Raises SignalRefused.
    """
    with transaction.atomic():
        job_id, row = _signal_target(job_id, client_id)
        status, _, reason, waits_for, _ = row
        if status in TERMINAL:
            raise SignalRefused("finished", f"job {job_id} has finished ({status})")
        if status == Status.QUEUED and reason == WaitReason.SIGNAL and waits_for != key:
            raise SignalRefused(
                "not_waiting", f"job {job_id} is waiting for the signal {waits_for!r}, not {key!r}"
            )
        admission.check_quota(admission.SIGNALS_PER_JOB, row[1], job_id)  # the job row is locked
        params = {"id": job_id, "key": key, "payload": payload_json, "actor": actor}
        if not _rows(_SIGNAL_INSERT_SQL, params):
            raise SignalRefused("duplicate", f"job {job_id} already has a signal {key!r}")
        woke = _rows(_SIGNAL_WAKE_SQL, params)
        signal_after_commit(woke, park_on_failure=False)
        _count_on_commit(metrics.SIGNALS, 1)
    return bool(woke)
