"""Submission's writes: the INSERT of one job (`submit`) and of a batch (`submit_many`).

Each is one statement that states the keys it must not collide with (ON CONFLICT DO
NOTHING on the idempotency and unique keys), so a refused insert says who holds the key
instead of raising; a key held in a cold partition rolls the insert back (D159). The
rules of what may be submitted live in jobs.validation and jobs.admission; this room
writes, counts what it wrote in the readings backpressure keeps (so the submission asks
the room once and is not asked back), and signals the due rows once the transaction
commits.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction

from jobs import admission, lifecycle, metrics
from jobs.conf import settings
from jobs.exceptions import BatchIdempotencyConflict, IdempotencyConflict
from jobs.lifecycle import NON_TERMINAL, Status
from jobs.models import Job, Queue
from jobs.services.common import T, _count_on_commit, _hot_rows, _rows, signal_after_commit

_JOB_FIELDS = [f.attname for f in Job._meta.concrete_fields]
QT = Queue._meta.db_table
_INSERT_SQL = f"""
INSERT INTO {T} (task, payload, queue, priority, run_at, max_retries, client_id,
                 idempotency_key, request_hash, updated_by, unique_key, concurrency_key,
                 timeout, trace_context, sequence_key, status, retry_count, lease_version)
VALUES (%s, %s::jsonb, %s, %s, COALESCE(%s, now()), %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,
        '{Status.QUEUED}', 0, 0)
ON CONFLICT DO NOTHING
RETURNING {", ".join(_JOB_FIELDS)}, run_at <= now(),
          EXISTS (SELECT FROM {QT} q WHERE q.name = %s AND q.paused)
"""
# The last column says whether the job's queue is paused, for the answer's wait reason
# (jobs.api.views.submitted_answer): uncorrelated, so one primary-key probe of jobs_queue
# per statement (an InitPlan), as the open-queue claim makes; the answer then reads
# nothing more.
# The live job holding a unique key (the partial unique index job_unique_key_live).
_KEY_HOLDER_SQL = f"""
SELECT {", ".join(_JOB_FIELDS)} FROM {T}
WHERE client_id IS NOT DISTINCT FROM %s AND unique_key = %s
  AND status IN ({lifecycle.sql_list(NON_TERMINAL)}) AND {lifecycle.hot_sql()}"""
# An idempotency key is unique per partition only (the index carries `period`): after
# the insert into hot, a later statement (a new snapshot) looks for the key in the
# cold partitions; a row the mover moved there meanwhile is seen, since the insert
# waited for the mover's delete from hot to commit (D159).
_COLD_KEYS_SQL = f"""
SELECT idempotency_key FROM {T}
WHERE client_id IS NOT DISTINCT FROM %s AND idempotency_key = ANY(%s)
  AND period < {lifecycle.HOT_PERIOD}"""


class _HeldCold(Exception):
    """Rolls back an insert whose idempotency key a cold job already holds."""

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys


def _insert_checked(
    sql: str, params: Any, client_id: int | None, keys: Callable[[list[tuple]], list[str]]
) -> list[tuple]:
    """Insert new jobs in a savepoint; raise _HeldCold (undoing them) when a key of
    `keys(rows)` (the inserted rows' idempotency keys) is held in a cold partition."""
    with transaction.atomic():
        rows = _hot_rows(sql, params)
        inserted = keys(rows)
        if inserted:
            cold = {r[0] for r in _rows(_COLD_KEYS_SQL, [client_id, inserted])}
            if cold:
                raise _HeldCold(cold)
    return rows


# A holder can finish between the refused insert and the read; the key is then free
# and the insert is tried again. Each round needs another job to take the key.
_KEY_ROUNDS = 5


def _job_from_row(row: Sequence[Any], *, binary: bool = False) -> Job:
    """A Job from a row of _JOB_FIELDS. Django loads jsonb as text, so a text row's
    payload is parsed here; a binary row's (_hot_rows) arrives parsed, strings included."""
    job = Job.from_db(connection.alias, _JOB_FIELDS, list(row[: len(_JOB_FIELDS)]))
    if not binary and isinstance(job.payload, str):
        job.payload = json.loads(job.payload)
    return job


def submit(
    task: str,
    payload: Any = None,
    *,
    client_id: int | None = None,
    actor: str = "app",
    queue: str = "default",
    priority: int = 0,
    run_at: datetime | None = None,
    max_retries: int | None = None,
    idempotency_key: str | None = None,
    request_hash: str | None = None,
    unique_key: str | None = None,
    payload_json: str | None = None,
    concurrency_key: str | None = None,
    timeout: float | None = None,
    trace_context: str | None = None,
    sequence_key: str | None = None,
) -> tuple[Job, bool]:
    """Insert a queued job inside the caller's transaction (the outbox of seed 002).

    The Redis push runs only when that transaction commits, so the job exists
    exactly when the caller's change does. Returns (job, created); a reused
    idempotency key returns the existing job, or raises IdempotencyConflict when
    `request_hash` differs. A `unique_key` held by a live job of the same client
    returns that job with `duplicate` set: the partial unique index decides, so
    concurrent submissions make one job. Validation of task and payload is the
    caller's (see jobs.submission); this is the write.
    """
    if max_retries is None:
        max_retries = settings.JOBS_MAX_RETRIES
    params = [
        task,
        payload_json
        if payload_json is not None  # already serialised by the caller's validation
        else json.dumps(payload if payload is not None else {}),
        queue,
        priority,
        run_at,
        max_retries,
        client_id,
        idempotency_key,
        request_hash,
        actor,
        unique_key,
        concurrency_key,
        timeout,
        trace_context,
        sequence_key,  # the database blocks it behind its sequence (jobs.flow.triggers)
        queue,  # whether it is paused (the RETURNING's last column)
    ]
    for _ in range(_KEY_ROUNDS):
        if idempotency_key is None:
            rows = _hot_rows(_INSERT_SQL, params)
        else:
            try:
                rows = _insert_checked(
                    _INSERT_SQL, params, client_id, lambda rows: [idempotency_key] if rows else []
                )
            except _HeldCold:
                rows = []
        if rows:
            break
        if idempotency_key is not None:
            existing = Job.objects.filter(
                client_id=client_id, idempotency_key=idempotency_key
            ).first()
            if existing is not None:
                if existing.request_hash != request_hash:
                    raise IdempotencyConflict(existing)
                return existing, False
        holder = key_holder(client_id, unique_key)
        if holder is not None:
            return holder, False
    else:
        raise RuntimeError(f"unique key {unique_key!r} changed hands {_KEY_ROUNDS} times")
    row = rows[0]
    job = _job_from_row(row, binary=True)
    due, job.queue_paused = row[-2], row[-1]  # the answer's wait reason (jobs.api.views)
    # Counted when the caller's transaction commits: a rolled-back job never existed.
    transaction.on_commit(metrics.SUBMITTED.labels(queue, task).inc)
    admission.count_accepted({queue: 1}, client_id)  # this process's readings, now
    if due:

        def parked(ids: list[int]) -> None:
            if job.pk in ids:  # callers reading the job after commit see the parked state
                job.status = Status.ENQUEUE_FAILED

        signal_after_commit([(job.pk, queue)], park_on_failure=True, on_parked=parked)
    return job, True


def key_holder(client_id: int | None, unique_key: str | None) -> Job | None:
    """The live job of this client holding `unique_key`, marked `duplicate`; or None."""
    if unique_key is None:
        return None
    rows = _rows(_KEY_HOLDER_SQL, [client_id, unique_key])
    if not rows:
        return None
    job = _job_from_row(rows[0])
    job.duplicate = True
    return job


@dataclass(frozen=True, slots=True)
class NewJob:
    """One item of `submit_many`: the same fields `submit` takes."""

    task: str
    payload: Any = None
    queue: str = "default"
    priority: int = 0
    run_at: datetime | None = None
    max_retries: int | None = None
    idempotency_key: str | None = None
    request_hash: str | None = None
    payload_json: str | None = None  # the payload already serialised (saves a second dumps)
    concurrency_key: str | None = None
    timeout: float | None = None  # seconds one attempt may run (jobs.watchdog)
    trace_context: str | None = None  # W3C traceparent[\ntracestate] (jobs.tracing)
    sequence_key: str | None = None  # one at a time per key, in order (jobs.flow)


@dataclass(frozen=True, slots=True)
class Submitted:
    """What `submit_many` reports per item, in input order."""

    job_id: int
    created: bool
    status: str
    queue: str
    task: str
    created_at: datetime
    run_at: datetime


_SUBMIT_MANY_SQL = f"""
WITH input AS MATERIALIZED (
  SELECT u.*, nextval(pg_get_serial_sequence('{T}', 'id')) AS id
  FROM unnest(%(tasks)s::text[], %(payloads)s::text[], %(queues)s::text[],
              %(priorities)s::int[], %(run_ats)s::timestamptz[], %(max_retries)s::int[],
              %(keys)s::text[], %(hashes)s::text[], %(ckeys)s::text[], %(timeouts)s::float8[],
              %(traces)s::text[], %(skeys)s::text[])
       WITH ORDINALITY AS u(task, payload, queue, priority, run_at, max_retries, key, hash,
                            ckey, timeout, trace, skey, ord)
), ins AS (
  INSERT INTO {T} (id, task, payload, queue, priority, run_at, max_retries, client_id,
                   idempotency_key, request_hash, updated_by, concurrency_key, timeout,
                   trace_context, status, retry_count, lease_version, sequence_key, batch_id)
  SELECT id, task, payload::jsonb, queue, priority, COALESCE(run_at, now()), max_retries,
         %(client)s, key, hash, %(actor)s, ckey, timeout, trace, '{Status.QUEUED}', 0, 0, skey,
         %(batch)s::bigint
  FROM input ORDER BY ord
  ON CONFLICT DO NOTHING
  RETURNING id, created_at, run_at
)
SELECT ins.id, ins.created_at, ins.run_at, ins.run_at <= now()
FROM input LEFT JOIN ins ON ins.id = input.id ORDER BY input.ord
"""


_EXISTING_KEYS_SQL = f"""
SELECT idempotency_key, id, request_hash, status, queue, task,
       created_at, run_at
FROM {T} WHERE client_id IS NOT DISTINCT FROM %s
  AND idempotency_key = ANY(%s)"""


_MANY_ARRAYS = ("tasks", "payloads", "queues", "priorities", "run_ats", "max_retries",
                "keys", "hashes", "ckeys", "timeouts", "traces", "skeys")  # fmt: skip


def _submit_many_rows(items: Sequence[NewJob], params: dict[str, Any]) -> list[tuple]:
    """The batch insert, one row per item (id None: not inserted). Items whose key a
    cold job holds are left out of a second try, and answered from that job. Without
    keys there is nothing to look up: one insert, no savepoint, no copies."""
    if not any(i.idempotency_key for i in items):
        return _hot_rows(_SUBMIT_MANY_SQL, params)
    cold: set[str] = set()
    for _ in range(_KEY_ROUNDS):
        todo = [n for n, i in enumerate(items) if i.idempotency_key not in cold]
        some = {**params, **{k: [params[k][n] for n in todo] for k in _MANY_ARRAYS}}

        def inserted_keys(rows: list[tuple], some: dict = some) -> list[str]:
            return [k for k, r in zip(some["keys"], rows, strict=True) if k and r[0] is not None]

        try:
            got = (
                _insert_checked(_SUBMIT_MANY_SQL, some, params["client"], inserted_keys)
                if todo
                else []
            )
        except _HeldCold as held:
            cold |= held.keys
            continue
        rows: list[tuple] = [(None,)] * len(items)
        for n, row in zip(todo, got, strict=True):
            rows[n] = row
        return rows
    raise RuntimeError(f"idempotency keys moved partition {_KEY_ROUNDS} times")


def submit_many(
    items: Sequence[NewJob],
    *,
    client_id: int | None = None,
    actor: str = "app",
    batch_id: int | None = None,
) -> list[Submitted]:
    """Insert many queued jobs in one statement; one Redis push for all of them on commit.

    All or nothing: runs in a (nested) transaction, and raises BatchIdempotencyConflict
    (writing nothing) when any item reuses a key with a different request_hash.
    An item whose key exists with the same request_hash reports the existing job
    (created=False), like `submit`. Validation is the caller's, as for `submit`.
    """
    if not items:
        return []
    default_retries = settings.JOBS_MAX_RETRIES
    params = {
        "tasks": [i.task for i in items],
        "payloads": [
            i.payload_json
            if i.payload_json is not None
            else json.dumps(i.payload if i.payload is not None else {})
            for i in items
        ],
        "queues": [i.queue for i in items],
        "priorities": [i.priority for i in items],
        "run_ats": [i.run_at for i in items],
        "max_retries": [default_retries if i.max_retries is None else i.max_retries for i in items],
        "keys": [i.idempotency_key for i in items],
        "hashes": [i.request_hash for i in items],
        "ckeys": [i.concurrency_key for i in items],
        "timeouts": [i.timeout for i in items],
        "traces": [i.trace_context for i in items],
        "skeys": [i.sequence_key for i in items],
        "batch": batch_id,  # a batch's jobs (jobs.flow.batches)
        "client": client_id,
        "actor": actor,
    }
    with transaction.atomic():
        rows = _submit_many_rows(items, params)
        missing = [n for n, r in enumerate(rows) if r[0] is None]
        existing: dict[str, tuple] = {}
        if missing:
            keys = [items[n].idempotency_key for n in missing]
            existing = {
                r[0]: r[1:]
                for r in _rows(
                    _EXISTING_KEYS_SQL,
                    [client_id, keys],
                )
            }
            conflicts = {
                n: existing[items[n].idempotency_key][0]
                for n in missing
                if existing[items[n].idempotency_key][1] != items[n].request_hash
            }
            if conflicts:
                raise BatchIdempotencyConflict(conflicts)
        out: list[Submitted] = []
        due: list[tuple[int, str]] = []
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for item, row in zip(items, rows, strict=True):
            if row[0] is None:
                job_id, _, status, queue, task, created_at, run_at = existing[item.idempotency_key]
                out.append(Submitted(job_id, False, status, queue, task, created_at, run_at))
                continue
            out.append(
                Submitted(row[0], True, Status.QUEUED, item.queue, item.task, row[1], row[2])
            )
            counts[(item.queue, item.task)] += 1
            if row[3]:
                due.append((row[0], item.queue))
        per_queue: dict[str, int] = defaultdict(int)
        for (queue, task), n in counts.items():
            _count_on_commit(metrics.child(metrics.SUBMITTED, queue, task), n)
            per_queue[queue] += n
        admission.count_accepted(per_queue, client_id)
        signal_after_commit(due, park_on_failure=True)
    return out
