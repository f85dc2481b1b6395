"""Every write to a job, one method per transition (SPEC §2–§5).

Each write is a single compare-and-set statement: its WHERE clause states the
state it expects, and the rows it returns say whether it held. Writes a worker
makes after claiming carry the authority predicate of SPEC §3
(id, lease_version, owned_by, status = 'processing'). Times come from the
database clock (`now()`), never from Python; a worker's final write uses
`statement_timestamp()`, so a transactional handler's job finishes when its
write is made, not when its transaction began. History rows are written by the
table's trigger from `updated_by`, so no path can skip them.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import psycopg
from django.db import IntegrityError, OperationalError, connection, transaction

from jobs import clientcache, lifecycle, metrics, quotas, waiting
from jobs.conf import settings
from jobs.exceptions import (
    BatchIdempotencyConflict,
    IdempotencyConflict,
    WorkflowIdempotencyConflict,
)
from jobs.flow import keyrate
from jobs.lifecycle import (
    BLOCKED_RUN_AT,
    CANCELLED,
    NON_TERMINAL,
    NOT_STARTED,
    TERMINAL,
    Role,
    Status,
    WaitReason,
    actor_role,
    actor_sql,
    due_sql,
)
from jobs.logconfig import job_log_fields
from jobs.models import Client, Job, JobEvent, JobSignal, JobStep, Queue, WorkerProcess
from jobs.transport import TransportError, get_transport

log = logging.getLogger(__name__)

T = Job._meta.db_table
# What a finished row needs to report its metrics. Latency counts from when the job
# became due (SPEC §6): `due_at`, or created_at on rows older than that column.
_FINISH_RETURNING = (
    "j.id, j.status, j.queue, j.task, j.retry_count, j.lease_version, "
    f"extract(epoch FROM j.finished_at - {due_sql('j')})"
)
_UNOWN = "owned_by = NULL, claimed_at = NULL, heartbeat_at = NULL"
# A start mark and a heartbeat are recoverable facts that write no history (D246): their
# transaction commits without waiting for the WAL flush, as SET LOCAL synchronous_commit
# = off would, inside the statement (no extra round trip). An InitPlan, so evaluated once,
# before the first row is written; it lasts to the end of the statement's transaction.
# A claim stays durable: its history row is an outbox event (D247).
_RECOVERABLE = "(SELECT set_config('synchronous_commit', 'off', true)) = 'off'"


@dataclass(frozen=True, slots=True)
class Lease:
    """A worker's authority over one job: valid while the row still matches."""

    job_id: int
    lease_version: int
    worker_id: str
    task: str
    payload: Any
    queue: str
    retry_count: int
    max_retries: int
    created_at: datetime
    priority: int = 0  # so a worker starts its prefetched jobs in the claim order
    # The previous attempt was requeued by crash recovery with no start on record: this
    # one's start is recorded before its handler is called (jobs.starts, D77).
    rerun: bool = False
    timeout: float | None = None  # the job's own attempt timeout (jobs.watchdog)

    def log_fields(self, **more: Any) -> dict[str, Any]:
        return job_log_fields(
            self.job_id, self.lease_version, self.worker_id, self.queue, self.task, **more
        )


@dataclass(frozen=True, slots=True)
class Finished:
    """A row a write moved out of processing (or a stale write that did not land)."""

    job_id: int
    status: str
    queue: str
    task: str
    retry_count: int
    lease_version: int
    time_to_terminal: float | None


def worker_actor(worker_id: str) -> str:
    return lifecycle.actor(Role.WORKER, worker_id)


# --- helpers ------------------------------------------------------------------


def _rows(sql: str, params: Sequence[Any] | dict[str, Any]) -> list[tuple]:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall() if cur.description else []


_TUPLES_OK = psycopg.pq.ExecStatus.TUPLES_OK


def _hot_rows(sql: str, params: Sequence[Any] | dict[str, Any]) -> list[tuple]:
    """The worker's hot-path statements: a plain psycopg cursor on Django's connection.

    Server-side parameter binding and a prepared statement per query text (parsed
    and planned once per connection), without Django's cursor wrapper. Same
    connection, so the same transaction as any surrounding `atomic()`; errors are
    translated to Django's exceptions like any other query. Behind PgBouncer in
    transaction mode this needs PgBouncer >= 1.21 with max_prepared_statements set.
    """
    # What Django's own cursor does first: a session the server ended since the last
    # request is replaced here, not found out by this statement (a 500 in the API).
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    with connection.wrap_database_errors:
        cur = _hot_cursor(connection.connection, sql)
        cur.execute(sql, params, prepare=True, binary=True)
        # A statement with RETURNING or SELECT has a result set even with no rows;
        # `description` would build a Column object per column to say so.
        return cur.fetchall() if cur.pgresult.status == _TUPLES_OK else []


def _hot_cursor(pgconn: psycopg.Connection, sql: str) -> psycopg.Cursor:
    """One cursor per hot statement and connection, kept on the connection: psycopg keeps
    a cursor's loaders while it runs the same query object again, where a new cursor
    would build one per column (a JSON loader each) for every call. A connection is one
    thread's (Django's are per thread), and goes with its cursors when it is replaced."""
    cursors = pgconn.__dict__.get("_jobs_hot_cursors")
    if cursors is None:
        cursors = pgconn._jobs_hot_cursors = {}
    cur = cursors.get(sql)
    if cur is None or cur.closed:
        cur = cursors[sql] = psycopg.Cursor(pgconn)
    return cur


def _count_on_commit(counter: Any, amount: int) -> None:
    """Count facts once they are committed (at once in autocommit)."""
    if amount:
        transaction.on_commit(partial(counter.inc, amount))


def _group_by_queue(pairs: Iterable[tuple[int, str]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for job_id, queue in pairs:
        out[queue].append(job_id)
    return dict(out)


def signal_after_commit(
    pairs: Iterable[tuple[int, str]],
    *,
    park_on_failure: bool,
    on_parked: Callable[[list[int]], None] | None = None,
) -> None:
    """Push job ids to Redis once the current transaction commits (SPEC §1).

    With `park_on_failure`, a failed push moves the still-queued rows to
    enqueue_failed in a second short transaction (the API's submission path),
    then tells `on_parked` which ids it parked.
    Otherwise (re-signals by workers and the reaper) a failed push is only
    counted: the row stays queued and the lost-signal sweep or polling finds it.
    """
    ids_by_queue = _group_by_queue(pairs)
    if not ids_by_queue:
        return

    def push() -> None:
        try:
            get_transport().push(ids_by_queue)
        except TransportError as exc:
            ids = [i for ids in ids_by_queue.values() for i in ids]
            if park_on_failure:
                parked = mark_enqueue_failed(ids, reason=str(exc))
                if on_parked is not None:
                    on_parked(parked)
                log.warning(
                    "redis push failed; %d job(s) parked as enqueue_failed: %s",
                    len(parked),
                    exc,
                    extra={"job_ids": parked[:20]},
                )
            else:
                log.warning(
                    "redis re-signal failed for %d job(s); polling will find them: %s",
                    len(ids),
                    exc,
                    extra={"job_ids": ids[:20]},
                )

    transaction.on_commit(push)


def push_now_ignoring_rollback(pairs: Iterable[tuple[int, str]]) -> None:
    """Push ids at once, even inside a transaction that may still roll back.

    Safe only for rows already committed (a wake-up for an uncommitted or
    rolled-back row is a harmless duplicate delivery). Raises TransportError.
    """
    get_transport().push(_group_by_queue(pairs))


# --- submission -----------------------------------------------------------------

_JOB_FIELDS = [f.attname for f in Job._meta.concrete_fields]
_INSERT_SQL = f"""
INSERT INTO {T} (task, payload, queue, priority, run_at, max_retries, client_id,
                 idempotency_key, request_hash, updated_by, unique_key, concurrency_key,
                 timeout, trace_context, sequence_key, status, retry_count, lease_version)
VALUES (%s, %s::jsonb, %s, %s, COALESCE(%s, now()), %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,
        '{Status.QUEUED}', 0, 0)
ON CONFLICT DO NOTHING
RETURNING {", ".join(_JOB_FIELDS)}, run_at <= now()
"""
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
    due = row[-1]
    # Counted when the caller's transaction commits: a rolled-back job never existed.
    transaction.on_commit(metrics.SUBMITTED.labels(queue, task).inc)
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
        for (queue, task), n in counts.items():
            _count_on_commit(metrics.child(metrics.SUBMITTED, queue, task), n)
        signal_after_commit(due, park_on_failure=True)
    return out


_PARK_SQL = f"""
UPDATE {T} SET status = '{Status.ENQUEUE_FAILED}', updated_by = '{Role.API}'
WHERE id = ANY(%s) AND {lifecycle.PARK.where()} RETURNING id, queue"""


def mark_enqueue_failed(job_ids: Sequence[int], reason: str = "") -> list[int]:
    """queued → enqueue_failed for rows whose push failed and nobody has claimed yet."""
    rows = _rows(
        _PARK_SQL,
        [list(job_ids)],
    )
    for _, queue in rows:
        metrics.ENQUEUE_FAILED.labels(queue).inc()
    return [r[0] for r in rows]


# --- claiming -------------------------------------------------------------------

# The claimed rows come back in claim order, so a batch starts best-first too. The
# `start` best of them (all when NULL) go straight to idle handler threads and are
# marked started here; the others by `mark_started` when a thread takes them (D77).
_CLAIM_SET = f"""
, u AS (
UPDATE {T} j SET status = '{Status.PROCESSING}', lease_version = j.lease_version + 1,
       owned_by = %(worker)s, claimed_at = now(), heartbeat_at = now(),
       started_at = CASE WHEN j.id = ANY(ARRAY(SELECT id FROM c LIMIT %(start)s))
                    THEN statement_timestamp() END,
       updated_by = %(actor)s
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
# The same claim under the queue's row lock, with the limit its controls allow.
_CLAIM_LIMITED_SQL = _claim_queue_sql()
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
                "actor": worker_actor(worker_id),
                "start": None if start is None else max(0, start - len(leases)),
            },
        )
        leases.extend(_leases(rows, worker_id))
    return leases


# --- fair share and concurrency keys (docs/queue-controls.md) ---------------------
#
# A fair queue's claim takes turns between clients: a loose index scan of
# job_fair_claim_idx visits up to `limit` clients with queued rows, starting after the
# client the worker served last and wrapping round, and takes each one's best rows
# (priority DESC, run_at, id) in rounds: every visited client's first row, then every
# second row. Each step is an index probe, so the cost grows with the clients visited,
# never with the backlog. NULL client_id (jobs from code) is one client, key 0.
_CK = "COALESCE(client_id, 0)"
_QUEUED_IN_QUEUE = f"{lifecycle.CLAIM.where()} AND queue = %(queue)s"


def _next_client_sql(op: str, bound: str) -> str:
    return (
        f"SELECT {_CK} FROM {T} WHERE {_QUEUED_IN_QUEUE} AND {_CK} {op} {bound} "
        f"ORDER BY queue, {_CK} LIMIT 1"
    )


def _fair_candidates_sql(also: str) -> str:
    """CTE `c(id, k, ord, key)`: the rows a fair claim takes, `ord` its turn order."""
    return f"""
RECURSIVE
after AS (
  SELECT ({_next_client_sql(">", "%(after)s::bigint")}) AS k, 1 AS i
  UNION ALL
  SELECT ({_next_client_sql(">", "a.k")}), a.i + 1 FROM after a
  WHERE a.k IS NOT NULL AND a.i < %(limit)s
), wrapped AS (
  SELECT ({_next_client_sql(">", "-1")}) AS k, 1 AS i
  UNION ALL
  SELECT ({_next_client_sql(">", "w.k")}), w.i + 1 FROM wrapped w
  WHERE w.k IS NOT NULL AND w.k < %(after)s::bigint AND w.i < %(limit)s
), visited AS (
  SELECT k, row_number() OVER (ORDER BY turn, k) AS turn FROM (
    SELECT k, 0 AS turn FROM after WHERE k IS NOT NULL
    UNION
    SELECT k, 1 FROM wrapped WHERE k IS NOT NULL AND k <= %(after)s::bigint
  ) v ORDER BY turn, k LIMIT %(limit)s
), share AS (SELECT ceil(%(limit)s::numeric / greatest(count(*), 1))::int AS n FROM visited),
rows_ AS (
  SELECT r.id, v.k, v.turn, r.key,
         row_number() OVER (PARTITION BY v.k ORDER BY r.ord) AS round
  FROM visited v, share, LATERAL (
    SELECT id, key, row_number() OVER (ORDER BY priority DESC, run_at, id) AS ord FROM (
      SELECT id, priority, run_at, concurrency_key AS key FROM {T}
      WHERE {_QUEUED_IN_QUEUE} AND {_CK} = v.k AND run_at <= now(){also}
      ORDER BY queue, {_CK}, priority DESC, run_at, id
      LIMIT share.n
      FOR UPDATE SKIP LOCKED
    ) s
  ) r
), c AS (
  SELECT id, k, row_number() OVER (ORDER BY round, turn) AS ord, key FROM rows_
  ORDER BY round, turn LIMIT %(limit)s
)"""


def _plain_candidates_sql(also: str) -> str:
    """CTE `c(id, k, ord, key)` in the plain claim order (a keyed queue that is not fair)."""
    return f"""
p AS (
  SELECT id, client_id, priority, run_at, concurrency_key FROM {T}
  WHERE {_QUEUED_IN_QUEUE} AND run_at <= now(){also}
  ORDER BY priority DESC, run_at, id
  LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED
), c AS (
  SELECT id, COALESCE(client_id, 0) AS k,
         row_number() OVER (ORDER BY priority DESC, run_at, id) AS ord, concurrency_key AS key
  FROM p
)"""


# A keyed queue: rows of keys already at their cap (the `full` arrays) are skipped by
# the scan; within the batch, a key's rows beyond what its cap leaves are dropped.
_NOT_FULL = """
    AND (concurrency_key IS NULL OR NOT EXISTS (
      SELECT FROM unnest(%(full_clients)s::bigint[], %(full_keys)s::text[]) f(k, key)
      WHERE f.k = COALESCE(client_id, 0) AND f.key = concurrency_key))"""
_KEYED = f"""
, keyed AS (
  SELECT id, k, ord, key, row_number() OVER (PARTITION BY k, key ORDER BY ord) AS nth
  FROM c
), picked AS (
  SELECT id, k, ord FROM keyed
  WHERE key IS NULL OR ((%(key_cap)s::int IS NULL OR nth + (
    SELECT count(*) FROM {T} x
    WHERE x.status = '{Status.PROCESSING}' AND x.queue = %(queue)s
      AND x.concurrency_key = keyed.key
      AND x.client_id IS NOT DISTINCT FROM nullif(keyed.k, 0)
  ) <= %(key_cap)s::int){keyrate.PICK_SQL})
)"""


def _claim_turns_sql(*, fair: bool, keyed: bool, also: str = "") -> str:
    """The claim of a fair and/or keyed queue. Returns the usual lease columns, then
    the client key (the worker's next `after`) and statement_timestamp() (the start
    a rate records), in turn order; the first `start` (all when NULL) are marked
    started (D77)."""
    filters = also + (_NOT_FULL if keyed else "")
    head = _fair_candidates_sql(filters) if fair else _plain_candidates_sql(filters)
    chosen = "picked" if keyed else "c"
    return f"""
WITH {head}{_KEYED if keyed else ""}
, u AS (
UPDATE {T} j SET status = '{Status.PROCESSING}', lease_version = j.lease_version + 1,
       owned_by = %(worker)s, claimed_at = now(), heartbeat_at = now(),
       started_at = CASE WHEN j.id = ANY(ARRAY(
                      SELECT id FROM {chosen} ORDER BY ord LIMIT %(start)s))
                    THEN statement_timestamp() END,
       updated_by = %(actor)s
WHERE j.id = ANY(ARRAY(SELECT id FROM {chosen})) AND {lifecycle.hot_sql("j")}
RETURNING j.id, j.lease_version, j.task, j.payload, j.queue, j.retry_count,
          j.max_retries, j.created_at, j.priority,
          coalesce(j.error LIKE '%%{NOT_STARTED}', false) AS rerun, j.timeout
)
SELECT u.id, lease_version, task, payload, queue, retry_count, max_retries, created_at,
       priority, rerun, timeout, t.k, statement_timestamp()
FROM u JOIN {chosen} t ON t.id = u.id ORDER BY t.ord
"""


# An open fair queue (no cap, rate or key cap): no lock, like the plain claim. A queue
# whose row says otherwise is claimed by the other claims only.
_FAIR_OPEN = (
    f"\n      AND NOT EXISTS (SELECT FROM {QT} q WHERE q.name = %(queue)s"
    f" AND (q.paused OR NOT q.fair OR {_LIMITED}))"
)
_CLAIM_FAIR_OPEN_SQL = _claim_turns_sql(fair=True, keyed=False, also=_FAIR_OPEN)
_CLAIM_TURNS_SQL = {
    (fair, keyed): _claim_turns_sql(fair=fair, keyed=keyed)
    for fair in (False, True)
    for keyed in (False, True)
}


_TURN_CLIENT = 11  # the client key's column in a turns claim's rows
# The turns claim costs milliseconds to plan, and PostgreSQL's plan cache kept planning
# it anew each time (its custom plans looked cheaper than the generic one), which made
# a fair drain tens of percent slower; the generic plan uses the same indexes.
_GENERIC_PLAN_SQL = "SET LOCAL plan_cache_mode = force_generic_plan"


@dataclass(frozen=True, slots=True)
class Turns:
    """What a fair claim got, and the client whose turn came last (the next `after`)."""

    leases: list[Lease]
    last_client: int


def claim_fair(
    worker_id: str, queue: str, limit: int, after: int = 0, *, start: int | None = None
) -> Turns:
    """queued → processing for up to `limit` due jobs of an open fair queue, clients
    taking turns from the one after `after`; never a paused, capped or keyed queue.
    The first `start` (all when None) are marked started (D77)."""
    with transaction.atomic(durable=True):
        _rows(_GENERIC_PLAN_SQL, [])
        rows = _hot_rows(
            _CLAIM_FAIR_OPEN_SQL,
            {"queue": queue, "limit": limit, "after": after, "worker": worker_id,
             "actor": worker_actor(worker_id), "start": start},
        )  # fmt: skip
    return Turns(_leases(rows, worker_id), rows[-1][_TURN_CLIENT] if rows else after)


_KEYS_FULL_SQL = f"""
SELECT COALESCE(client_id, 0), concurrency_key, count(*) FROM {T}
WHERE status = '{Status.PROCESSING}' AND queue = %(queue)s AND concurrency_key IS NOT NULL
GROUP BY 1, 2 HAVING count(*) >= %(key_cap)s"""
KEYED_ROUNDS = 8  # each round claims at least one job or finds none left


def _claim_in_turns_under_queue_lock(
    worker_id: str,
    queue: str,
    allowed: int,
    *,
    fair: bool,
    key_cap: int | None,
    after: int,
    start: int | None,
    key_rate: tuple[int, int] | None = None,
) -> tuple[list[tuple], float | None]:
    """The claim of a fair or keyed queue, inside claim_limited_under_queue_lock's
    transaction. Returns the rows and, when keys at their cap or rate held jobs back,
    the seconds until one may start again (else None).

    Under the queue's lock no other claim of the queue runs, so the processing rows
    and starts (jobs.flow.keyrate) counted per key stay counted until this
    transaction commits. A batch that keys at their cap or rate cut short is claimed
    again, the full keys skipped, so the jobs of other keys behind a full key's
    backlog still start.
    """
    sql = _CLAIM_TURNS_SQL[(fair, key_cap is not None or key_rate is not None)]
    _rows(_GENERIC_PLAN_SQL, [])
    params: dict[str, Any] = {
        "queue": queue, "after": after, "worker": worker_id,
        "actor": worker_actor(worker_id), "key_cap": key_cap, "start": start,
        **keyrate.NO_RATE,
    }  # fmt: skip
    if key_cap is None and key_rate is None:
        return _hot_rows(sql, {**params, "limit": allowed}), None

    def keys_full() -> tuple[set[tuple[int, str]], keyrate.Window | None]:
        capped = {(r[0], r[1]) for r in _rows(_KEYS_FULL_SQL, params)} if key_cap else set()
        window = None if key_rate is None else keyrate.start_window(queue, *key_rate)
        return capped, window

    capped, window = keys_full()
    full = capped | (window.full if window is not None else set())
    out: list[tuple] = []
    for _ in range(KEYED_ROUNDS):
        want = allowed - len(out)
        if want <= 0:
            break
        rows = _hot_rows(
            sql,
            {**params, "limit": want, "full_clients": [k for k, _ in full],
             "full_keys": [key for _, key in full],
             "start": None if start is None else max(0, start - len(out)),
             **(window.params() if window is not None else {})},
        )  # fmt: skip
        if window is not None and rows:
            keyrate.record_starts([r[0] for r in rows], rows[-1][-1])
        out += rows
        if len(rows) == want:
            break
        # Fewer than asked: either no due row is left, or keys reached their cap or rate.
        capped, window = keys_full()
        now_full = capped | (window.full if window is not None else set())
        if now_full <= full or not rows:
            full = now_full
            break
        full = now_full
    if not full or len(out) >= allowed:
        return out, None
    waits = [CAP_RECHECK_SECONDS] if capped else []
    due = window.next_due() if window is not None else None
    return out, min([*waits, *([due] if due is not None else [])], default=CAP_RECHECK_SECONDS)


# The queue's row lock serialises every claim of a limited queue (and its pause). The
# statements after it begin once the previous holder committed: they read its claims.
_QUEUE_LOCK_SQL = (
    "SELECT paused, concurrency, rate_limit, rate_period, fair, key_concurrency,"
    f" key_rate_limit, key_rate_period FROM {QT} WHERE name = %s FOR UPDATE"
)
_QUEUE_STATE_SQL = f"""
SELECT statement_timestamp(), rate_starts,
       CASE WHEN concurrency IS NULL THEN 0 ELSE (
         SELECT count(*) FROM {T} WHERE status = '{Status.PROCESSING}' AND queue = %(queue)s)
       END
FROM {QT} WHERE name = %(queue)s"""
_QUEUE_STARTS_SQL = f"UPDATE {QT} SET rate_starts = %s WHERE name = %s"
# The limited claim also returns its statement_timestamp(): the history's `at`.
_CLAIM_LIMITED_SQL = _CLAIM_LIMITED_SQL.replace(
    "timeout\nFROM u", "timeout, statement_timestamp()\nFROM u"
)
assert "timeout, statement_timestamp()\nFROM u" in _CLAIM_LIMITED_SQL
CAP_RECHECK_SECONDS = 0.2  # when a slot frees is not known: how soon to look again


@dataclass(frozen=True, slots=True)
class Gated:
    """What a claim of a limited queue got, and whether its controls cut it short.

    `blocked_for` is None when the controls allowed every job asked for, else the
    seconds until a slot or a token may be due: CAP_RECHECK_SECONDS for a cap, the
    exact time for a rate, inf when paused (until someone resumes it).
    """

    leases: list[Lease]
    blocked_for: float | None = None
    last_client: int = 0  # a fair queue: the client whose turn came last


def claim_limited_under_queue_lock(
    worker_id: str, queue: str, limit: int, after: int = 0, *, start: int | None = None
) -> Gated:
    """queued → processing for up to `limit` due jobs of a queue with controls, never
    more than its concurrency cap processing at once nor more than its rate's starts
    in any window of its period, however many workers claim at once.

    Under the queue row's lock (FOR UPDATE), the processing rows and the window of
    starts are read at a statement_timestamp() later than every start recorded (each
    holder committed before this one locked), and each start is recorded with its claim
    statement's statement_timestamp(), the history's `at`. So for any window of the
    period, the last claim to start a job in it counted every earlier start in it.
    A `key_concurrency` caps the jobs of each concurrency key the same way (counted
    under the same lock); a fair queue's claim takes turns between clients from the
    one after `after`. Hazard: every claim of the queue waits for the lock, so keep
    this transaction short.
    """
    with transaction.atomic(durable=True):
        rows = _rows(_QUEUE_LOCK_SQL, [queue])
        if not rows:  # no controls row (not synced yet): an open queue
            return Gated(claim_next(worker_id, [queue], limit, start=start))
        paused, cap, rate, period, fair, key_cap, key_rate, key_period = rows[0]
        if paused:
            return Gated([], float("inf"))
        now, starts, running = _rows(_QUEUE_STATE_SQL, {"queue": queue})[0]
        allowed, blocked_for = limit, None
        if cap is not None and cap - running < allowed:
            allowed, blocked_for = max(0, cap - running), CAP_RECHECK_SECONDS
        window: list[datetime] = []
        if rate is not None:
            since = now - timedelta(seconds=period)
            window = sorted((s for s in starts if s > since), reverse=True)
            if rate - len(window) < allowed:
                allowed = max(0, rate - len(window))
                # After this claim, the rate-th newest start is the first to leave.
                first_out = window[rate - allowed - 1] if rate > allowed else now
                due = (first_out + timedelta(seconds=period) - now).total_seconds()
                blocked_for = max(blocked_for or 0.0, due, 0.001)
        if allowed <= 0:
            return Gated([], blocked_for)
        last_client = after
        if fair or key_cap is not None or key_rate is not None:
            rows, keys_wait = _claim_in_turns_under_queue_lock(
                worker_id, queue, allowed, fair=fair, key_cap=key_cap, after=after,
                start=start, key_rate=None if key_rate is None else (key_rate, key_period),
            )  # fmt: skip
            if keys_wait is not None:
                blocked_for = max(blocked_for or 0.0, keys_wait)
            last_client = rows[-1][_TURN_CLIENT] if fair and rows else after
        else:
            rows = _hot_rows(
                _CLAIM_LIMITED_SQL,
                {"queue": queue, "limit": allowed, "worker": worker_id,
                 "actor": worker_actor(worker_id), "start": start},
            )  # fmt: skip
        if rate is not None and rows:
            _rows(_QUEUE_STARTS_SQL, [[r[-1] for r in rows] + window, queue])
        return Gated(_leases(rows, worker_id), blocked_for, last_client)


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
            "actor": worker_actor(worker_id),
            "start": start,
        },
    )
    return _leases(rows, worker_id)


def claim(worker_id: str, job_id: int) -> Lease | None:
    leases = claim_ids(worker_id, [job_id])
    return leases[0] if leases else None


# --- fenced writes by the lease holder --------------------------------------------

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


def _finished(rows: list[tuple]) -> dict[int, Finished]:
    out = {}
    ended = [r[0] for r in rows if r[1] in (Status.DONE, Status.FAILED)]
    if ended:  # one announcement per write-back, once it committed (jobs.waiting)
        transaction.on_commit(partial(waiting.announce, ended))
    for r in rows:
        f = Finished(r[0], r[1], r[2], r[3], r[4], r[5], float(r[6]) if r[6] is not None else None)
        out[f.job_id] = f
        if f.status in (Status.DONE, Status.FAILED):
            # Immediate in autocommit; inside a transaction (a transactional handler),
            # only once the terminal state has committed.
            transaction.on_commit(
                partial(
                    metrics.observe_terminal,
                    f.queue,
                    f.task,
                    f.status,
                    f.time_to_terminal,
                    f.retry_count,
                )
            )
    return out


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


# --- the reaper -------------------------------------------------------------------


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


# --- staff and clients ------------------------------------------------------------


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


_MOVED_ATTEMPTS = 3


def moved_retry(run: Callable[[], Any]) -> Any:
    """Run a write to finished jobs, again in a new snapshot when it met the mover.

    A row the mover (jobs.partitions) moved to a cold partition after the statement's
    snapshot cannot be locked there: PostgreSQL raises 40001 ("already moved to
    another partition"). The mover moves a row once, so the next attempt finds it
    where it now is (D162). Live jobs never move: only paths that touch finished
    jobs need this."""
    for attempt in range(_MOVED_ATTEMPTS):
        try:
            with transaction.atomic():
                return run()
        except OperationalError as exc:
            moved = isinstance(exc.__cause__, psycopg.errors.SerializationFailure)
            if not moved or attempt == _MOVED_ATTEMPTS - 1:
                raise
            log.info("a job moved partition under a write; trying again")
    raise AssertionError("unreachable")


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


# --- retention --------------------------------------------------------------------

_H = JobEvent._meta.db_table


# Row-wise retention reads the hot partition only: a cold period goes whole, by
# partition (jobs.archive.retention), once every job of it is finished and moved.
_HOT = "jobs_job_hot"

_PRUNE_SQL = f"""
WITH victims AS (
  SELECT id FROM {_HOT}
  WHERE status = ANY(%(statuses)s)
    AND finished_at < now() - %(age)s * interval '1 second'
  LIMIT %(batch)s
  FOR UPDATE SKIP LOCKED),
ev AS (DELETE FROM {_H} WHERE job_id IN (SELECT id FROM victims)),
steps AS (DELETE FROM jobs_jobstep WHERE job_id IN (SELECT id FROM victims)),
sigs AS (DELETE FROM jobs_jobsignal WHERE job_id IN (SELECT id FROM victims)),
nodes AS (DELETE FROM jobs_workflownode WHERE job_id IN (SELECT id FROM victims)),
edges AS (DELETE FROM jobs_jobdependency
          WHERE child_id IN (SELECT id FROM victims) OR parent_id IN (SELECT id FROM victims)),
-- A webhook delivery goes with its delivery job (jobs.events): its status was the job's.
dl AS (DELETE FROM jobs_webhookdelivery WHERE job_id IN (SELECT id FROM victims)),
gone AS (DELETE FROM {_HOT} WHERE id IN (SELECT id FROM victims) RETURNING 1)
SELECT count(*) FROM gone"""


def prune_finished(older_than_seconds: float, statuses: Sequence[str], batch: int) -> int:
    """Delete one batch of terminal jobs still in jobs_job_hot and finished more than
    `older_than_seconds` ago (database clock), with their history, steps, signals and
    workflow links; returns how many jobs went.

    One short statement: rows another transaction holds are skipped (SKIP LOCKED),
    so workers, the reaper and a concurrent prune never wait on it. Only terminal
    statuses are accepted, and the table's trigger refuses to delete any other row.
    """
    bad = sorted(set(statuses) - TERMINAL)
    if bad or not statuses:
        raise ValueError(f"only terminal jobs can be pruned, not {', '.join(bad) or 'nothing'}")
    if older_than_seconds <= 0 or batch <= 0:
        raise ValueError("older_than_seconds and batch must be positive")
    params = {"statuses": sorted(set(statuses)), "age": older_than_seconds, "batch": batch}
    return moved_retry(partial(_rows, _PRUNE_SQL, params))[0][0]


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


# --- durable jobs: steps, waits, signals (jobs.durable) -----------------------------

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
# keeps the lease.
_STEP_SQL = f"""
WITH f AS (
  SELECT j.id, j.lease_version FROM {T} j WHERE {_FENCE_ONE} FOR SHARE),
ins AS (
  INSERT INTO {_STEP} (job_id, name, result, lease_version, worker_id, created_at)
  SELECT f.id, %(name)s, %(result)s::jsonb, f.lease_version, %(owner)s, statement_timestamp()
  FROM f
  ON CONFLICT (job_id, name) DO NOTHING
  RETURNING id)
SELECT (SELECT count(*) FROM f), (SELECT count(*) FROM ins)"""


def checkpoint_step(lease: Lease, name: str, result_json: str) -> bool:
    """Store a step's result under the lease's fence; False when the fence refused it
    (the lease is stale: the step's effects were not recorded)."""
    rows = _rows(
        _STEP_SQL,
        {
            "id": lease.job_id,
            "lv": lease.lease_version,
            "owner": lease.worker_id,
            "name": name,
            "result": result_json,
        },
    )
    return bool(rows[0][0])


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
        quotas.check_room(quotas.SIGNALS_PER_JOB, row[1], job_id)  # the job row is locked
        params = {"id": job_id, "key": key, "payload": payload_json, "actor": actor}
        if not _rows(_SIGNAL_INSERT_SQL, params):
            raise SignalRefused("duplicate", f"job {job_id} already has a signal {key!r}")
        woke = _rows(_SIGNAL_WAKE_SQL, params)
        signal_after_commit(woke, park_on_failure=False)
        _count_on_commit(metrics.SIGNALS, 1)
    return bool(woke)


# --- workflows (jobs.workflows; the database side is jobs.graph) ---------------------

_WORKFLOW_INSERT_SQL = """
INSERT INTO jobs_workflow (name, on_failure, client_id, unfinished, idempotency_key,
                           request_hash, created_at)
VALUES (%s, %s, %s, %s, %s, %s, now())
ON CONFLICT DO NOTHING RETURNING id"""
_WORKFLOW_BY_KEY_SQL = """
SELECT id, request_hash FROM jobs_workflow
WHERE client_id IS NOT DISTINCT FROM %s AND idempotency_key = %s"""
_WORKFLOW_IDS_SQL = (
    f"SELECT nextval(pg_get_serial_sequence('{T}', 'id')) FROM generate_series(1, %s)"
)
_WORKFLOW_JOBS_SQL = f"""
INSERT INTO {T} (id, task, payload, queue, priority, run_at, max_retries, client_id,
                 updated_by, status, retry_count, lease_version, wait_reason, concurrency_key,
                 timeout, trace_context)
SELECT u.id, u.task, u.payload::jsonb, u.queue, u.priority,
       CASE WHEN u.blocked THEN %(blocked)s::timestamptz ELSE now() END,
       u.max_retries, %(client)s, %(actor)s, '{Status.QUEUED}', 0, 0,
       CASE WHEN u.blocked THEN '{WaitReason.PARENTS}' END, u.ckey, u.timeout, %(trace)s
FROM unnest(%(ids)s::bigint[], %(tasks)s::text[], %(payloads)s::text[], %(queues)s::text[],
            %(priorities)s::int[], %(max_retries)s::int[], %(blocked_flags)s::boolean[],
            %(ckeys)s::text[], %(timeouts)s::float8[])
     AS u(id, task, payload, queue, priority, max_retries, blocked, ckey, timeout)"""
_WORKFLOW_NODES_SQL = """
INSERT INTO jobs_workflownode (job_id, workflow_id, key, pending_parents, ended)
SELECT u.id, %(workflow)s, u.key, u.pending, false
FROM unnest(%(ids)s::bigint[], %(keys)s::text[], %(pending)s::int[]) AS u(id, key, pending)"""
_WORKFLOW_EDGES_SQL = """
INSERT INTO jobs_jobdependency (child_id, parent_id)
SELECT u.child, u.parent FROM unnest(%(children)s::bigint[], %(parents)s::bigint[])
     AS u(child, parent)"""


def create_workflow(
    name: str,
    on_failure: str,
    steps: Sequence[tuple[str, Sequence[str], dict[str, Any]]],
    *,
    client_id: int | None = None,
    actor: str = "app",
    idempotency_key: str | None = None,
    request_hash: str | None = None,
    trace_context: str | None = None,
) -> tuple[int, bool]:
    """Insert a checked workflow (jobs.workflows.build): every job, node and edge in one
    (nested) transaction. Each step is (id, parent ids, checked submission arguments).
    Jobs without parents are due now and signalled on commit; the others wait for the
    database to count their parents down (jobs.graph). Returns (workflow id, created):
    a reused idempotency key returns the existing workflow, or raises
    WorkflowIdempotencyConflict when `request_hash` differs."""
    with transaction.atomic():
        row = _rows(
            _WORKFLOW_INSERT_SQL,
            [name, on_failure, client_id, len(steps), idempotency_key, request_hash],
        )
        if not row:
            existing_id, existing_hash = _rows(_WORKFLOW_BY_KEY_SQL, [client_id, idempotency_key])[
                0
            ]
            if existing_hash != request_hash:
                raise WorkflowIdempotencyConflict(existing_id)
            return existing_id, False
        workflow_id = row[0][0]
        ids = [r[0] for r in _rows(_WORKFLOW_IDS_SQL, [len(steps)])]
        by_key = {key: job_id for (key, _, _), job_id in zip(steps, ids, strict=True)}
        default_retries = settings.JOBS_MAX_RETRIES
        jobs = [job for _, _, job in steps]
        _hot_rows(
            _WORKFLOW_JOBS_SQL,
            {
                "ids": ids,
                "tasks": [j["task"] for j in jobs],
                "payloads": [j["payload_json"] for j in jobs],
                "queues": [j["queue"] for j in jobs],
                "priorities": [j["priority"] for j in jobs],
                "max_retries": [
                    default_retries if j["max_retries"] is None else j["max_retries"] for j in jobs
                ],
                "blocked_flags": [bool(after) for _, after, _ in steps],
                "ckeys": [j.get("concurrency_key") for j in jobs],
                "timeouts": [j.get("timeout") for j in jobs],
                "trace": trace_context,
                "blocked": BLOCKED_RUN_AT,
                "client": client_id,
                "actor": actor,
            },
        )
        _hot_rows(
            _WORKFLOW_NODES_SQL,
            {
                "workflow": workflow_id,
                "ids": ids,
                "keys": [key for key, _, _ in steps],
                "pending": [len(after) for _, after, _ in steps],
            },
        )
        edges = [(by_key[key], by_key[p]) for key, after, _ in steps for p in after]
        if edges:
            _hot_rows(
                _WORKFLOW_EDGES_SQL,
                {"children": [c for c, _ in edges], "parents": [p for _, p in edges]},
            )
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for job in jobs:
            counts[(job["queue"], job["task"])] += 1
        for (queue, task), n in counts.items():
            _count_on_commit(metrics.child(metrics.SUBMITTED, queue, task), n)
        roots = [(job_id, job["queue"]) for (_, after, job), job_id in zip(steps, ids, strict=True)
                 if not after]  # fmt: skip
        signal_after_commit(roots, park_on_failure=True)
    return workflow_id, True


# Children a statement's ends just made due (jobs.graph) are found by polling; this
# pushes them at once (a hint only: the wake-up itself is committed), and reports the
# workflows these ends finished (their finished_at is the ending statement's time).
_AFTER_ENDS_SQL = f"""
SELECT j.id, j.queue, NULL::float8 FROM jobs_jobdependency d JOIN {T} j ON j.id = d.child_id
WHERE d.parent_id = ANY(%(ids)s::bigint[]) AND {lifecycle.WAKE.where("j.status")}
  AND j.run_at <= now() AND j.wait_reason IS NULL
UNION ALL
SELECT DISTINCT w.id, NULL, extract(epoch FROM w.finished_at - w.created_at)::float8
FROM jobs_workflownode wn JOIN jobs_workflow w ON w.id = wn.workflow_id
JOIN {T} j ON j.id = wn.job_id
WHERE wn.job_id = ANY(%(ids)s::bigint[]) AND w.finished_at = j.finished_at"""


def signal_woken_children(parent_ids: Sequence[int]) -> None:
    """Push the workflow children that the end of `parent_ids` made due (on commit), and
    observe the completion time of the workflows those ends finished."""
    if not parent_ids:
        return
    rows = _hot_rows(_AFTER_ENDS_SQL, {"ids": list(parent_ids)})
    signal_after_commit([r[:2] for r in rows if r[1] is not None], park_on_failure=False)
    for r in rows:
        if r[1] is None and r[2] is not None:
            metrics.WORKFLOW_SECONDS.observe(max(0.0, r[2]))
