"""Reads: cheap, index-served queries for the reaper, the SLO report and dashboards.

Every aggregate here is bounded by an index, never by the table: live states
are counted through their partial indexes (job_claim_idx, job_processing_id_idx,
job_enqueue_failed_idx), finished jobs through job_finished_idx over a time
window, and the table size comes from the planner's estimate. All times come
from the database clock. `tests/test_admin_dashboard.py` checks each plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import connection
from django.db.models import F, QuerySet
from django.db.models.functions import Now

from jobs.lifecycle import NON_TERMINAL, Status, due_sql, sql_list
from jobs.models import Job, WorkerProcess

T = Job._meta.db_table
DUE = due_sql()  # latency counts from when a job became due (SPEC §6)
DASHBOARD_CACHE_SECONDS = 5
DASHBOARD_WINDOW_SECONDS = 3600

# queued rows, through the partial claim index (queue, priority, run_at, id).
QUEUED_SQL = f"""
SELECT queue, count(*), count(*) FILTER (WHERE run_at <= now()),
       extract(epoch FROM now() - min(run_at) FILTER (WHERE run_at <= now()))
FROM {T} WHERE status = '{Status.QUEUED}' GROUP BY queue"""

# processing rows, through the partial index on heartbeat_at.
PROCESSING_SQL = f"""
SELECT queue, count(*),
       count(*) FILTER (WHERE heartbeat_at < now() - %(lease)s * interval '1 second')
FROM {T} WHERE status = '{Status.PROCESSING}' GROUP BY queue"""

# enqueue_failed rows, through their partial index.
ENQUEUE_FAILED_SQL = f"""
SELECT queue, count(*), extract(epoch FROM now() - min(updated_at))
FROM {T} WHERE status = '{Status.ENQUEUE_FAILED}' GROUP BY queue"""

# Jobs finished in the window, through job_finished_idx: per minute and per queue.
FINISHED_SQL = f"""
SELECT date_trunc('minute', finished_at), queue, status, count(*),
       count(*) FILTER (WHERE finished_at - {DUE} <= %(slo)s * interval '1 second')
FROM {T} WHERE finished_at >= now() - %(window)s * interval '1 second'
GROUP BY GROUPING SETS ((date_trunc('minute', finished_at), status), (queue, status))"""

# Due → terminal latency percentiles over the same window.
LATENCY_SQL = f"""
SELECT percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP
         (ORDER BY extract(epoch FROM finished_at - {DUE}))
FROM {T} WHERE finished_at >= now() - %(window)s * interval '1 second'"""

# Live workers per queue served ('*' serves every queue): the registry is one row per
# worker process; live means it beat within a lease.
CONSUMERS_SQL = f"""
SELECT q.queue, count(*) FROM {WorkerProcess._meta.db_table} w, unnest(w.queues) AS q(queue)
WHERE w.heartbeat_at >= now() - %(lease)s * interval '1 second'
GROUP BY q.queue"""
ESTIMATE_SQL = "SELECT reltuples::bigint FROM pg_class WHERE oid = %(table)s::regclass"
NOW_SQL = "SELECT now()"


def dashboard_queries(
    lease_seconds: float | None = None,
    slo_seconds: float | None = None,
    window_seconds: int = DASHBOARD_WINDOW_SECONDS,
) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, sql, params) of every query the dashboard runs, for the view and for EXPLAIN."""
    params = {
        "lease": settings.JOBS_LEASE_SECONDS if lease_seconds is None else lease_seconds,
        "slo": settings.JOBS_SLO_SECONDS if slo_seconds is None else slo_seconds,
        "window": window_seconds,
        "table": T,
    }
    return [
        ("queued", QUEUED_SQL, params),
        ("processing", PROCESSING_SQL, params),
        ("enqueue_failed", ENQUEUE_FAILED_SQL, params),
        ("finished", FINISHED_SQL, params),
        ("latency", LATENCY_SQL, params),
        ("consumers", CONSUMERS_SQL, params),
        ("estimate", ESTIMATE_SQL, params),
        ("now", NOW_SQL, params),
    ]


@dataclass
class QueueRow:
    queue: str
    queued: int = 0
    queued_due: int = 0
    oldest_due_seconds: float | None = None
    processing: int = 0
    stuck: int = 0
    enqueue_failed: int = 0
    done: int = 0
    failed: int = 0
    consumers: int = 0  # live workers serving this queue, `*` workers included

    @property
    def unserved(self) -> bool:
        """Jobs wait here and no live worker serves the queue: they would wait forever."""
        return self.queued > 0 and self.consumers == 0


@dataclass
class MinuteBar:
    minute: datetime
    done: int = 0
    failed: int = 0

    @property
    def total(self) -> int:
        return self.done + self.failed


@dataclass
class Dashboard:
    """What the admin dashboard shows; counts of finished jobs cover the window only."""

    now: datetime
    window_seconds: int
    lease_seconds: float
    slo_seconds: float
    queues: list[QueueRow]
    minutes: list[MinuteBar]
    total_estimate: int
    finished: int = 0
    done: int = 0
    failed: int = 0
    within_slo: int = 0
    latency_p50: float | None = None
    latency_p95: float | None = None
    latency_p99: float | None = None
    totals: QueueRow = field(default_factory=lambda: QueueRow("all"))

    @property
    def slo_attainment(self) -> float | None:
        """Share of jobs finished in the window within the SLO, failures counted."""
        return self.within_slo / self.finished if self.finished else None

    @property
    def success_rate(self) -> float | None:
        return self.done / self.finished if self.finished else None

    @property
    def unserved(self) -> list[QueueRow]:
        return [q for q in self.queues if q.unserved]

    @property
    def oldest_due_seconds(self) -> float | None:
        ages = [q.oldest_due_seconds for q in self.queues if q.oldest_due_seconds is not None]
        return max(ages) if ages else None

    @property
    def state_counts(self) -> dict[str, int]:
        t = self.totals
        return {
            Status.QUEUED.value: t.queued,
            Status.PROCESSING.value: t.processing,
            Status.ENQUEUE_FAILED.value: t.enqueue_failed,
            f"{Status.DONE.value} (window)": t.done,
            f"{Status.FAILED.value} (window)": t.failed,
        }


def _fetch(sql: str, params: dict[str, Any] | list[Any]) -> list[tuple]:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def dashboard(
    window_seconds: int = DASHBOARD_WINDOW_SECONDS,
    lease_seconds: float | None = None,
    slo_seconds: float | None = None,
) -> Dashboard:
    """Compute the dashboard from the database (uncached; see `cached_dashboard`)."""
    queries = {
        name: (sql, params)
        for name, sql, params in dashboard_queries(lease_seconds, slo_seconds, window_seconds)
    }
    params = queries["now"][1]
    rows: dict[str, QueueRow] = {}

    def row(queue: str) -> QueueRow:
        return rows.setdefault(queue, QueueRow(queue))

    for queue, count, due, oldest in _fetch(*queries["queued"]):
        r = row(queue)
        r.queued, r.queued_due = count, due
        r.oldest_due_seconds = float(oldest) if oldest is not None else None
    for queue, count, stuck in _fetch(*queries["processing"]):
        r = row(queue)
        r.processing, r.stuck = count, stuck
    for queue, count, _oldest in _fetch(*queries["enqueue_failed"]):
        row(queue).enqueue_failed = count

    now = _fetch(*queries["now"])[0][0]
    first_minute = now.replace(second=0, microsecond=0) - timedelta(
        seconds=window_seconds - 60
    )
    bars = {
        first_minute + timedelta(minutes=i): MinuteBar(first_minute + timedelta(minutes=i))
        for i in range(max(window_seconds // 60, 1))
    }
    board = Dashboard(
        now=now,
        window_seconds=window_seconds,
        lease_seconds=params["lease"],
        slo_seconds=params["slo"],
        queues=[],
        minutes=[],
        total_estimate=max(int(_fetch(*queries["estimate"])[0][0] or 0), 0),
    )
    for minute, queue, status, count, within in _fetch(*queries["finished"]):
        if minute is not None:  # the (minute, status) grouping set
            bar = bars.get(minute)
            if bar is None:  # the partial minute at the window's start
                bar = bars.setdefault(minute, MinuteBar(minute))
            setattr(bar, status, getattr(bar, status) + count)
            board.finished += count
            board.within_slo += within
            if status == Status.DONE:
                board.done += count
            else:
                board.failed += count
        else:  # the (queue, status) grouping set
            r = row(queue)
            setattr(r, status, getattr(r, status) + count)
    (percentiles,) = _fetch(*queries["latency"])[0]
    if percentiles:
        board.latency_p50, board.latency_p95, board.latency_p99 = (
            float(p) if p is not None else None for p in percentiles
        )
    consumers = consumer_counts(_fetch(*queries["consumers"]))
    for r in rows.values():
        r.consumers = consumers(r.queue)
    board.queues = sorted(rows.values(), key=lambda r: r.queue)
    board.minutes = [bars[k] for k in sorted(bars)][-max(window_seconds // 60, 1) :]
    totals = QueueRow("all")
    for r in board.queues:
        for name in ("queued", "queued_due", "processing", "stuck", "enqueue_failed", "done"):
            setattr(totals, name, getattr(totals, name) + getattr(r, name))
        totals.failed += r.failed
    totals.oldest_due_seconds = board.oldest_due_seconds
    board.totals = totals
    return board


def cached_dashboard(ttl: int = DASHBOARD_CACHE_SECONDS) -> Dashboard:
    """The dashboard, recomputed at most every `ttl` seconds per cache."""
    key = (
        f"jobs:dashboard:{DASHBOARD_WINDOW_SECONDS}:"
        f"{settings.JOBS_LEASE_SECONDS}:{settings.JOBS_SLO_SECONDS}"
    )
    return cache.get_or_set(key, dashboard, ttl)


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
        return sorted(r[0] for r in _fetch(KNOWN_QUEUES_SQL, {"recent": recent}))

    return cache.get_or_set(f"jobs:known_queues:{recent}", fetch, ttl)


# --- counting for the admin list ----------------------------------------------------


def table_estimate(model: type = Job) -> int:
    """The planner's row estimate for a table (pg_class.reltuples); -1 if never analysed."""
    rows = _fetch(ESTIMATE_SQL, {"table": model._meta.db_table})
    return int(rows[0][0]) if rows else -1


def plan_estimate(queryset: QuerySet) -> int:
    """The planner's row estimate for a queryset, from EXPLAIN (no rows are read)."""
    sql, params = queryset.order_by().values("pk").query.sql_with_params()
    with connection.cursor() as cur:
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
    return consumer_counts(_fetch(CONSUMERS_SQL, {"lease": lease}))


def db_now():
    """The database clock, which decides everything (SPEC §1): the one way to read it."""
    return _fetch(NOW_SQL, [])[0][0]


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
    rows = Job.objects.due(older_than).filter(
        updated_at__lte=Now() - timedelta(seconds=older_than)
    )
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
    return [r[0] for r in _fetch(QUEUED_QUEUES_SQL, [])]


@dataclass(frozen=True)
class SloReport:
    window_seconds: float
    slo_seconds: float
    terminal: int
    within_slo: int
    done: int
    failed: int
    p50: float | None
    p95: float | None
    p99: float | None

    @property
    def attainment(self) -> float | None:
        """Share of terminal jobs (done or failed) that got there within the SLO."""
        return self.within_slo / self.terminal if self.terminal else None

    @property
    def success_rate(self) -> float | None:
        return self.done / self.terminal if self.terminal else None


# Due → terminal latency (SPEC §6) of the jobs finished in a window, failures counted:
# the one definition of the latency percentiles and of "within the SLO".
FINISHED_IN_WINDOW = "finished_at >= now() - %(window)s * interval '1 second'"
WITHIN_SLO = f"finished_at - {DUE} <= %(slo)s * interval '1 second'"
LATENCY_PERCENTILES = (
    "percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP"
    f" (ORDER BY extract(epoch FROM finished_at - {DUE}))"
)
SLO_SQL = f"""
SELECT count(*), count(*) FILTER (WHERE {WITHIN_SLO}),
       count(*) FILTER (WHERE status = '{Status.DONE}'),
       count(*) FILTER (WHERE status = '{Status.FAILED}'),
       {LATENCY_PERCENTILES}
FROM {T} WHERE {FINISHED_IN_WINDOW}"""


def slo_report(window_seconds: float, slo_seconds: float) -> SloReport:
    """Due → terminal latency over jobs finished in the window (failures counted): from
    submission for an immediate job, from run_at for a scheduled one (SPEC §6)."""
    row = _fetch(SLO_SQL, {"slo": slo_seconds, "window": window_seconds})[0]
    pct = row[4] or [None, None, None]
    return SloReport(window_seconds, slo_seconds, row[0], row[1], row[2], row[3], *pct)


# --- metrics: depth and age by state (exported by the reaper) ---------------------

DEPTH_SQL = f"""
SELECT status, queue, count(*),
       extract(epoch FROM now() - min(CASE status
         WHEN '{Status.QUEUED}' THEN CASE WHEN run_at <= now()
                                          THEN greatest(run_at, updated_at) END
         WHEN '{Status.PROCESSING}' THEN claimed_at
         ELSE updated_at END))
FROM {T}
WHERE status IN ({sql_list(NON_TERMINAL)})
GROUP BY status, queue"""


def depth_by_state() -> list[tuple[str, str, int, float]]:
    """(state, queue, rows, oldest age in seconds) for every non-terminal state and
    queue, in one grouped statement that reads only non-terminal rows through the
    status indexes (about 50 ms with 100k queued among 1M rows; the reaper caches it).

    Age is how long the oldest row has waited in that state: a queued row since it
    became due (greatest of run_at and its last write, so scheduled and backed-off
    rows count from their run_at and future ones not at all), a processing row
    since its claim, an enqueue_failed row since it was parked. 0 when none.
    """
    return [
        (status, queue, count, max(0.0, float(age or 0.0)))
        for status, queue, count, age in _fetch(DEPTH_SQL, [])
    ]


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
