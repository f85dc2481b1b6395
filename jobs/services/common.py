"""What every room of the services shares: the Lease a claim hands out, the Finished
row a final write reports, the two ways a statement runs (`_rows` through Django's
cursor; `_hot_rows`, a prepared statement on a kept cursor, for the hot paths), and what
a write does once it commits: its counts, the waiters it wakes and the Redis signals
(below). Times come from the database clock (`now()`), never from Python. History rows
are written by the table's trigger from `updated_by`, so no path can skip them.
`moved_retry` runs a write to finished jobs again when the partition mover got there
first (D162).

The Redis side of a write: job ids pushed once their transaction commits (SPEC §1).
PostgreSQL holds every fact and Redis only signals, so a lost push costs latency, never
a job: the submission path parks a row whose push failed (queued → enqueue_failed, for
the reaper to repair); every other re-signal is only counted, and polling or the
lost-signal sweep finds the row. Workflow children a statement made due are pushed the
same way (a hint: the wake-up itself is committed by the graph's trigger).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

import psycopg
from django.db import OperationalError, connection, transaction

from jobs import lifecycle, metrics, waiting
from jobs.lifecycle import Role, Status, due_sql
from jobs.logconfig import job_log_fields
from jobs.models import Job
from jobs.transport import TransportError, get_transport

log = logging.getLogger(__name__)

T = Job._meta.db_table
# The partition of live jobs (lifecycle.hot_sql): a statement about one live job that
# names it plans like a plain table, where jobs_job's plan weighs every partition.
HOT = f"{T}_hot"
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


# --- the Redis signals sent once a write commits ------------------------------------


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
