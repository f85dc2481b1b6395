"""Reads: cheap, index-served queries for the reaper, the SLO report and the admin (the
metrics' readings are jobs.gauges).

Every aggregate here is bounded by an index, never by the table: live states
are counted through their partial indexes (job_claim_idx, job_processing_id_idx,
job_enqueue_failed_idx), finished jobs through job_finished_idx over a time
window, and the table size comes from the planner's estimate. All times come
from the database clock. The admin dashboard's own statements live in
`jobs.admin.dashboard`; `tests/test_admin_dashboard.py` checks each plan.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.core.cache import cache
from django.db import connection
from django.db.models import F, QuerySet
from django.db.models.functions import Now

from jobs import replica
from jobs.conf import settings
from jobs.lifecycle import (
    CANCEL,
    CANCELLED,
    NON_TERMINAL,
    Status,
    WaitReason,
    due_sql,
    hot_sql,
    sql_list,
)
from jobs.models import Job, JobEvent, Queue, WorkerProcess

T = Job._meta.db_table
DUE = due_sql()  # latency counts from when a job became due (SPEC §6)

# Live workers per queue served ('*' serves every queue): the registry is one row per
# worker process; live means it beat within a lease.
CONSUMERS_SQL = f"""
SELECT q.queue, count(*) FROM {WorkerProcess._meta.db_table} w, unnest(w.queues) AS q(queue)
WHERE w.heartbeat_at >= now() - %(lease)s * interval '1 second'
GROUP BY q.queue"""
# A partitioned table's own reltuples stays -1 (autovacuum analyses its partitions
# only): the estimate is the sum over its partitions; -1 when none was analysed.
ESTIMATE_SQL = """
SELECT CASE WHEN bool_and(c.reltuples < 0) THEN -1 ELSE sum(greatest(c.reltuples, 0)) END::bigint
FROM pg_class c
WHERE (c.oid = %(table)s::regclass AND c.relkind <> 'p')
   OR c.oid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = %(table)s::regclass)"""
NOW_SQL = "SELECT now()"


# Queue names worth offering as a filter: those with live jobs (status index) and
# those among the newest jobs (pk index, bounded) — never DISTINCT over the table.
KNOWN_QUEUES_SQL = f"""
SELECT queue FROM {T}
WHERE status IN ({sql_list(NON_TERMINAL)})
UNION
SELECT queue FROM (SELECT queue FROM {T} ORDER BY id DESC LIMIT %(recent)s) AS newest"""


def known_queues(ttl: int = 30, recent: int = 10_000) -> list[str]:
    """Queues with live jobs or among the newest `recent` jobs, cached `ttl` seconds."""

    def fetch() -> list[str]:
        return sorted(r[0] for r in replica.fetch(KNOWN_QUEUES_SQL, {"recent": recent}))

    return cache.get_or_set(f"jobs:known_queues:{recent}", fetch, ttl)


# --- counting for the admin list ----------------------------------------------------


def table_estimate(model: type = Job) -> int:
    """The planner's row estimate for a table (pg_class.reltuples); -1 if never analysed."""
    rows = replica.fetch(ESTIMATE_SQL, {"table": model._meta.db_table})
    return int(rows[0][0]) if rows else -1


def plan_estimate(queryset: QuerySet) -> int:
    """The planner's row estimate for a queryset, from EXPLAIN (no rows are read)."""
    sql, params = queryset.order_by().values("pk").query.sql_with_params()
    with replica.connection().cursor() as cur:
        cur.execute("EXPLAIN (FORMAT JSON) " + sql, params)
        plan = cur.fetchone()[0]
    if isinstance(plan, str):
        import json

        plan = json.loads(plan)
    return int(plan[0]["Plan"]["Plan Rows"])


def capped_count(queryset: QuerySet, cap: int) -> tuple[int, bool]:
    """(count, exact): the exact count up to `cap`; past it, the planner's estimate.

    Counting stops after cap + 1 rows, so a page view never counts a million
    rows; past the cap the estimate (at least cap + 1) is returned with exact=False.
    """
    n = queryset.order_by().values("pk")[: cap + 1].count()
    if n <= cap:
        return n, True
    if not queryset.query.where:
        estimate = table_estimate(queryset.model)
    else:
        estimate = plan_estimate(queryset)
    return max(estimate, n), False


# --- the reaper and the SLO report ---------------------------------------------


def consumer_counts(rows: list[tuple[str, int]]):
    """From (queue served, live workers) rows, a function: queue → live workers serving it."""
    served = dict(rows)
    everything = served.pop("*", 0)
    return lambda queue: served.get(queue, 0) + everything


def queue_consumers(lease_seconds: float | None = None):
    """queue → live workers serving it (see CONSUMERS_SQL)."""
    lease = settings.JOBS_LEASE_SECONDS if lease_seconds is None else lease_seconds
    return consumer_counts(replica.fetch(CONSUMERS_SQL, {"lease": lease}))


def db_now():
    """The database clock, which decides everything (SPEC §1): the one way to read it."""
    return replica.fetch(NOW_SQL, [])[0][0]


def came_due(since, until, limit: int) -> list[tuple[int, str]]:
    """Queued jobs whose run_at passed in (since, until] and lay in the future when the
    row was last written (scheduled or backed off): nobody signalled them when due."""
    rows = Job.objects.queued().filter(run_at__gt=since, run_at__lte=until)
    rows = rows.filter(run_at__gt=F("updated_at"))
    return list(rows.order_by("run_at").values_list("id", "queue")[:limit])


def waiting_too_long(
    queues: list[str] | None, older_than: float, limit: int
) -> list[tuple[int, str]]:
    """Due queued jobs untouched for `older_than` seconds: their signal may be lost."""
    rows = Job.objects.due(older_than).filter(updated_at__lte=Now() - timedelta(seconds=older_than))
    if queues is not None:
        rows = rows.filter(queue__in=queues)
    return list(rows.order_by("-priority", "run_at", "id").values_list("id", "queue")[:limit])


# A loose index scan over the partial claim index: one probe per distinct queue.
QUEUED_QUEUES_SQL = f"""
WITH RECURSIVE q AS (
  (SELECT queue FROM {T} WHERE status = '{Status.QUEUED}' ORDER BY queue LIMIT 1)
  UNION ALL
  SELECT (SELECT queue FROM {T} WHERE status = '{Status.QUEUED}' AND queue > q.queue
          ORDER BY queue LIMIT 1) FROM q WHERE q.queue IS NOT NULL)
SELECT queue FROM q WHERE queue IS NOT NULL"""


def queued_queues() -> list[str]:
    """Queues that have queued jobs (see QUEUED_QUEUES_SQL)."""
    return [r[0] for r in replica.fetch(QUEUED_QUEUES_SQL, [])]


class FinishedShares:
    """The two shares of the jobs finished in a window (SPEC §6), failures counted."""

    within_slo: int
    done: int
    terminal: int
    cancelled_unstarted: int

    @property
    def attainment(self) -> float | None:
        """Share of terminal jobs (done or failed) that got there within the SLO."""
        return self.within_slo / self.terminal if self.terminal else None

    @property
    def success_rate(self) -> float | None:
        """Share of done among the jobs that ran or were due to: a job cancelled while
        it waited never ran, and is no failure of anything (D225)."""
        ran = self.terminal - self.cancelled_unstarted
        return self.done / ran if ran else None


@dataclass(frozen=True)
class SloReport(FinishedShares):
    window_seconds: float
    slo_seconds: float
    terminal: int
    within_slo: int
    done: int
    failed: int
    p50: float | None
    p95: float | None
    p99: float | None
    cancelled_unstarted: int = 0


# Due → terminal latency (SPEC §6) of the jobs finished in a window, failures counted:
# the one definition of the latency percentiles and of "within the SLO", read by
# `manage.py slo` and the admin dashboard.
FINISHED_IN_WINDOW = "finished_at >= now() - %(window)s * interval '1 second'"
# Failed by a cancel while it waited (a running job's cancel is a request on the row).
CANCELLED_UNSTARTED = (
    f"status = '{Status.FAILED}' AND error = '{CANCELLED}' AND cancel_requested_at IS NULL"
)
WITHIN_SLO = f"finished_at - {DUE} <= %(slo)s * interval '1 second'"
LATENCY_PERCENTILES = (
    "percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP"
    f" (ORDER BY extract(epoch FROM finished_at - {DUE}))"
)
SLO_SQL = f"""
SELECT count(*), count(*) FILTER (WHERE {WITHIN_SLO}),
       count(*) FILTER (WHERE status = '{Status.DONE}'),
       count(*) FILTER (WHERE status = '{Status.FAILED}'),
       {LATENCY_PERCENTILES},
       count(*) FILTER (WHERE {CANCELLED_UNSTARTED})
FROM {T} WHERE {FINISHED_IN_WINDOW}"""


def slo_report(window_seconds: float, slo_seconds: float) -> SloReport:
    """Due → terminal latency over jobs finished in the window (failures counted): from
    submission for an immediate job, from run_at for a scheduled one (SPEC §6)."""
    row = replica.fetch(SLO_SQL, {"slo": slo_seconds, "window": window_seconds})[0]
    pct = row[4] or [None, None, None]
    return SloReport(window_seconds, slo_seconds, row[0], row[1], row[2], row[3], *pct, row[5])


def progress_of(job: Job) -> dict[str, Any] | None:
    """The stored report with its fraction (done / total, clamped to [0, 1])."""
    report = job.progress
    if not isinstance(report, dict):
        return None
    done, total = report.get("done"), report.get("total")
    fraction = None
    if isinstance(total, int | float) and total > 0 and isinstance(done, int | float):
        fraction = round(min(1.0, max(0.0, done / total)), 4)
    return {
        "done": done,
        "total": total,
        "fraction": fraction,
        "message": report.get("message", ""),
        "updated_at": report.get("updated_at"),
    }


@dataclass(frozen=True, slots=True)
class QueueControl:
    """A queue's controls as a worker reads them (jobs.queuecontrol)."""

    name: str
    paused: bool
    concurrency: int | None
    rate_limit: int | None
    rate_period: int | None
    weight: float | None
    fair: bool = False
    key_concurrency: int | None = None
    key_rate_limit: int | None = None
    key_rate_period: int | None = None
    # Claimed under the queue's row lock (a cap, a rate, a per-key cap or rate). Set once
    # when the row is read: every claim of the worker asks it.
    limited: bool = field(init=False)

    def __post_init__(self) -> None:
        limited = (
            self.concurrency is not None
            or self.rate_limit is not None
            or self.key_concurrency is not None
            or self.key_rate_limit is not None
        )
        object.__setattr__(self, "limited", limited)


def paused_queues() -> list[str]:
    return list(Queue.objects.filter(paused=True).order_by("name").values_list("name", flat=True))


def queue_controls() -> dict[str, QueueControl]:
    """Every jobs_queue row (a handful: one per declared queue), by name."""
    fields = (
        "name", "paused", "concurrency", "rate_limit", "rate_period", "weight", "fair",
        "key_concurrency", "key_rate_limit", "key_rate_period",
    )  # fmt: skip
    return {r[0]: QueueControl(*r) for r in Queue.objects.values_list(*fields)}


# The last id drawn from a table's sequence, committed or not (0: none yet): every row
# written after the read gets a larger one. Read on the primary (a replica may be behind).
LAST_DRAWN_SQL = """
SELECT COALESCE(pg_sequence_last_value(pg_get_serial_sequence(%s, 'id')::regclass), 0)
"""


_DUE_DELIVERIES_SQL = f"""
SELECT j.id FROM {T} j JOIN jobs_webhookdelivery d ON d.job_id = j.id
WHERE j.status = '{Status.QUEUED}' AND {hot_sql("j")} AND j.queue = %(queue)s
  AND j.run_at <= now() AND d.webhook_id = %(webhook)s
ORDER BY j.priority DESC, j.run_at, j.id
LIMIT %(limit)s
"""


def due_deliveries(webhook_id: int, queue: str, limit: int) -> list[int]:
    """The delivery jobs of one endpoint that are due now, in claim order: an endpoint's
    run takes them a batch at a time (jobs.events.batches)."""
    with connection.cursor() as cur:
        cur.execute(_DUE_DELIVERIES_SQL, {"webhook": webhook_id, "queue": queue, "limit": limit})
        return [r[0] for r in cur.fetchall()]


def last_drawn_id(table: str = "jobs_jobevent") -> int:
    """Where ids of `table` (the history by default) stand now; the outbox's horizon and
    a new webhook's first event (`after_event_id`, D194) are placed by it."""
    with connection.cursor() as cur:
        cur.execute(LAST_DRAWN_SQL, [table])
        return cur.fetchone()[0]


# --- why a queued job waits -------------------------------------------------------------

# Not a stored WaitReason: the queue's state, read when a job is shown.
QUEUE_PAUSED = "queue_paused"
PAUSED_QUEUES_SQL = "SELECT name FROM jobs_queue WHERE paused"
PAUSED_QUEUES_MAX_AGE = 1.0
_paused_queues: tuple[float, frozenset[str]] = (-PAUSED_QUEUES_MAX_AGE, frozenset())


def paused_queues_cached() -> frozenset[str]:
    """The paused queues, read at most once a second per process (a page of jobs, or a
    submission's answer, costs no query each)."""
    global _paused_queues
    at, names = _paused_queues
    now = time.monotonic()
    if now - at >= PAUSED_QUEUES_MAX_AGE:
        names = frozenset(r[0] for r in replica.fetch(PAUSED_QUEUES_SQL, []))
        _paused_queues = (now, names)
    return names


def forget_paused_queues() -> None:
    global _paused_queues
    _paused_queues = (-PAUSED_QUEUES_MAX_AGE, frozenset())


def wait_reason(job: Job) -> str | None:
    """Why a queued job is not running: parked or blocked (stored), or its queue paused."""
    if job.wait_reason:
        return job.wait_reason
    if job.status == Status.QUEUED and job.queue in paused_queues_cached():
        return QUEUE_PAUSED
    return None


def progress_and_wait(job: Job) -> tuple[dict[str, Any] | None, str | None]:
    """What a job's answer shows beyond its columns, read in one call: its progress
    (progress_of) and why it waits (wait_reason)."""
    return progress_of(job), wait_reason(job)


# --- durable jobs and workflows ------------------------------------------------------

# In commit order (a replay checks the code asks for the same steps in the same order).
JOB_STEPS_SQL = "SELECT name, result, now() FROM jobs_jobstep WHERE job_id = %s ORDER BY id"
JOB_SIGNAL_SQL = "SELECT payload FROM jobs_jobsignal WHERE job_id = %s AND key = %s"
PARENT_OUTCOMES_SQL = f"""
SELECT wn.key, p.status, p.result, p.error
FROM jobs_jobdependency d JOIN {T} p ON p.id = d.parent_id
JOIN jobs_workflownode wn ON wn.job_id = p.id
WHERE d.child_id = %s"""


def _json_value(value: Any) -> Any:
    # Django's psycopg setup hands raw-SQL jsonb back as text.
    return json.loads(value) if isinstance(value, str) else value


def job_steps(job_id: int) -> tuple[dict[str, Any], Any]:
    """A job's committed checkpoints {name: result}, and the database clock now."""
    rows = replica.fetch(JOB_STEPS_SQL, [job_id])
    if not rows:
        return {}, db_now()
    return {r[0]: _json_value(r[1]) for r in rows}, rows[0][2]


def trace_context(job_id: int) -> str | None:
    """The trace context a job was submitted in (jobs.observability; read only while
    tracing is on, so the claim stays as it was)."""
    rows = replica.fetch(f"SELECT trace_context FROM {T} WHERE id = %s", [job_id])
    return rows[0][0] if rows else None


def job_signal(job_id: int, key: str) -> tuple[bool, Any]:
    """(delivered, payload) of the signal `key` of a job."""
    rows = replica.fetch(JOB_SIGNAL_SQL, [job_id, key])
    return (True, _json_value(rows[0][0])) if rows else (False, None)


def parent_outcomes(job_id: int) -> tuple[dict[str, Any], dict[str, str]]:
    """A workflow job's parents: {step id: result} of those done, {step id: error} of
    those failed."""
    results, errors = {}, {}
    for key, status, result, error in replica.fetch(PARENT_OUTCOMES_SQL, [job_id]):
        if status == Status.DONE:
            results[key] = _json_value(result)
        elif status == Status.FAILED:
            errors[key] = error
    return results, errors


WORKFLOW_SQL = """
SELECT id, name, on_failure, created_at, finished_at, client_id
FROM jobs_workflow WHERE id = %s"""
WORKFLOW_STEPS_SQL = f"""
SELECT wn.key, j.id, j.task, j.queue, j.status, j.wait_reason, j.result, j.error,
       j.retry_count, j.created_at, j.finished_at,
       coalesce((SELECT array_agg(pn.key ORDER BY pn.key) FROM jobs_jobdependency d
                 JOIN jobs_workflownode pn ON pn.job_id = d.parent_id
                 WHERE d.child_id = wn.job_id), '{{}}')
FROM jobs_workflownode wn JOIN {T} j ON j.id = wn.job_id
WHERE wn.workflow_id = %s
ORDER BY j.id"""


def workflow_key_used(client_id: int | None, idempotency_key: str) -> bool:
    """Whether the client already created a workflow under this key (a replay)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT EXISTS (SELECT 1 FROM jobs_workflow WHERE client_id IS NOT DISTINCT FROM %s"
            " AND idempotency_key = %s)",
            [client_id, idempotency_key],
        )
        return cur.fetchone()[0]


def workflow_detail(workflow_id: int, client_id: int | None = None) -> dict[str, Any] | None:
    """A workflow with each step's job and state; None when missing or (with
    `client_id`) another client's."""
    rows = replica.fetch(WORKFLOW_SQL, [workflow_id])
    if not rows or (client_id is not None and rows[0][5] != client_id):
        return None
    wf_id, name, on_failure, created_at, finished_at, _ = rows[0]
    steps = [
        {
            "id": r[0],
            "job_id": r[1],
            "task": r[2],
            "queue": r[3],
            "status": r[4],
            "wait_reason": r[5],
            "result": _json_value(r[6]),
            "error": r[7],
            "retry_count": r[8],
            "created_at": r[9],
            "finished_at": r[10],
            "after": list(r[11]),
        }
        for r in replica.fetch(WORKFLOW_STEPS_SQL, [workflow_id])
    ]
    statuses = {s["status"] for s in steps}
    if finished_at is None:
        state = "running"
    else:
        state = Status.FAILED.value if Status.FAILED in statuses else Status.DONE.value
    return {
        "id": wf_id,
        "name": name,
        "on_failure": on_failure,
        "status": state,
        "created_at": created_at,
        "finished_at": finished_at,
        "steps": steps,
    }


JOB_HISTORY_SQL = """
SELECT count(*) FILTER (WHERE left(name, 1) <> '~'),
       count(*) FILTER (WHERE left(name, 1) = '~'), coalesce(sum(pg_column_size(result)), 0)
FROM jobs_jobstep WHERE job_id = %s"""


def job_history(job_id: int) -> dict[str, int]:
    """A durable run's stored history: its steps, its waits (and patch markers) and the
    bytes of their results."""
    steps, waits, size = replica.fetch(JOB_HISTORY_SQL, [job_id])[0]
    return {"steps": int(steps), "waits": int(waits), "bytes": int(size)}


def open_wait_is_old(job: Job) -> bool:
    """A job parked on a signal wait without a timeout, created longer than
    JOBS_OPEN_WAIT_WARN_AGE ago (the database clock)."""
    if job.status != Status.QUEUED or job.wait_reason != WaitReason.SIGNAL:
        return False
    if job.run_at is None or job.run_at.year < 9999:  # a timeout: a timer, not an open wait
        return False
    return job.created_at < db_now() - timedelta(seconds=float(settings.JOBS_OPEN_WAIT_WARN_AGE))


IN_WORKFLOW_SQL = "SELECT EXISTS (SELECT 1 FROM jobs_workflownode WHERE job_id = %s)"


def in_workflow(job_id: int) -> bool:
    """Whether the job is a step of a workflow."""
    return bool(replica.fetch(IN_WORKFLOW_SQL, [job_id])[0][0])


WORKFLOWS_RUNNING_SQL = "SELECT EXISTS (SELECT 1 FROM jobs_workflow WHERE finished_at IS NULL)"


def workflows_running() -> bool:
    """Whether any workflow is unfinished (the partial index workflow_running_idx)."""
    return bool(replica.fetch(WORKFLOWS_RUNNING_SQL, [])[0][0])


# --- jobs from the command line (manage.py jobs) -------------------------------------


def job_listing(
    *,
    statuses: Sequence[str] = (),
    queue: str | None = None,
    task: str | None = None,
    client: str | None = None,
    since: datetime | None = None,
    limit: int = 50,
) -> list[Job]:
    """The newest jobs matching every filter given, newest first, at most `limit`.

    `client` is a client's name, or its id when all digits. Tracebacks, payloads and
    results stay in the table: a listing shows none of them.
    """
    qs = Job.objects.select_related("client").defer("error_traceback", "payload", "result")
    if statuses:
        qs = qs.in_states(statuses)
    if queue is not None:
        qs = qs.filter(queue=queue)
    if task is not None:
        qs = qs.filter(task=task)
    if client is not None:
        by = {"client_id": int(client)} if client.isdigit() else {"client__name": client}
        qs = qs.filter(**by)
    if since is not None:
        qs = qs.filter(created_at__gte=since)
    return list(qs.order_by("-id")[:limit])


def job_with_history(job_id: int) -> tuple[Job, list[JobEvent]] | None:
    """A job and every row of its history, oldest first; None when there is no such job."""
    job = Job.objects.select_related("client").filter(pk=job_id).first()
    if job is None:
        return None
    return job, list(JobEvent.objects.filter(job_id=job_id).order_by("id"))


def missing_job_ids(job_ids: Sequence[int]) -> list[int]:
    """The ids of `job_ids` no job has."""
    found = set(Job.objects.filter(pk__in=job_ids).values_list("pk", flat=True))
    return sorted(set(job_ids) - found)


def jobs_by_id(job_ids: Sequence[int]) -> QuerySet:
    """The jobs of `job_ids`, as a queryset a staff action selects from."""
    return Job.objects.filter(pk__in=list(job_ids))


def not_started_in_queue(queue: str) -> QuerySet:
    """A queue's jobs that have not started (queued or enqueue_failed), up to the newest
    one now: what a purge confirmed is what it cancels, not a job submitted after."""
    qs = Job.objects.filter(queue=queue).eligible_for(CANCEL)
    newest = qs.order_by("-pk").values_list("pk", flat=True).first()
    return qs.filter(pk__lte=newest or 0)


def job_status(job_id: int, client_id: int | None = None) -> str | None:
    """A job's status now (of that client's jobs, when given); None when there is none."""
    qs = Job.objects.filter(pk=job_id)
    if client_id is not None:
        qs = qs.filter(client_id=client_id)
    return qs.values_list("status", flat=True).first()


def jobs_in_bulk(job_ids: list[int]) -> dict[int, Job]:
    """The rows of these jobs as they are now (jobs.testing reads each after its attempt)."""
    return Job.objects.in_bulk(job_ids)
