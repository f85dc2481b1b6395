"""The admin's job dashboard: its statements, its figures, its chart and its view.

Every statement is bounded by an index, never by the table: live states through
their partial indexes, finished jobs through job_finished_idx over the window,
the table size from the planner's estimate; latency is the SLO report's own
statement (`selectors.SLO_SQL`). `tests/test_admin_dashboard.py` checks each plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin
from django.core.cache import cache
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.translation import gettext as _

from jobs import replica, selectors
from jobs.admin.display import percent
from jobs.conf import settings
from jobs.events import kafka, webhooks
from jobs.events.lag import lag
from jobs.events.sources import DOMAIN, HISTORY
from jobs.lifecycle import Status
from jobs.models import Job

T = Job._meta.db_table
DUE = selectors.DUE
DASHBOARD_CACHE_SECONDS = 5
DASHBOARD_WINDOW_SECONDS = 3600
SLO_TARGET = 0.95

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
       count(*) FILTER (WHERE finished_at - {DUE} <= %(slo)s * interval '1 second'),
       count(*) FILTER (WHERE {selectors.CANCELLED_UNSTARTED})
FROM {T} WHERE finished_at >= now() - %(window)s * interval '1 second'
GROUP BY GROUPING SETS ((date_trunc('minute', finished_at), status), (queue, status))"""


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
        (Status.QUEUED.value, QUEUED_SQL, params),
        (Status.PROCESSING.value, PROCESSING_SQL, params),
        (Status.ENQUEUE_FAILED.value, ENQUEUE_FAILED_SQL, params),
        ("finished", FINISHED_SQL, params),
        ("latency", selectors.SLO_SQL, params),
        ("consumers", selectors.CONSUMERS_SQL, params),
        ("estimate", selectors.ESTIMATE_SQL, params),
        ("now", selectors.NOW_SQL, params),
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
    paused: bool = False  # nothing starts from it until someone resumes it

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
class Dashboard(selectors.FinishedShares):
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
    cancelled_unstarted: int = 0  # failed while waiting: not counted in the success rate
    latency_p50: float | None = None
    latency_p95: float | None = None
    latency_p99: float | None = None
    totals: QueueRow = field(default_factory=lambda: QueueRow("all"))
    paused: list[QueueRow] = field(default_factory=list)  # paused queues, with or without jobs

    @property
    def terminal(self) -> int:
        return self.finished

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

    for queue, count, due, oldest in replica.fetch(*queries[Status.QUEUED]):
        r = row(queue)
        r.queued, r.queued_due = count, due
        r.oldest_due_seconds = float(oldest) if oldest is not None else None
    for queue, count, stuck in replica.fetch(*queries[Status.PROCESSING]):
        r = row(queue)
        r.processing, r.stuck = count, stuck
    for queue, count, _oldest in replica.fetch(*queries[Status.ENQUEUE_FAILED]):
        row(queue).enqueue_failed = count

    now = replica.fetch(*queries["now"])[0][0]
    first_minute = now.replace(second=0, microsecond=0) - timedelta(seconds=window_seconds - 60)
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
        total_estimate=max(int(replica.fetch(*queries["estimate"])[0][0] or 0), 0),
    )
    for minute, queue, status, count, within, cancelled in replica.fetch(*queries["finished"]):
        if minute is not None:  # the (minute, status) grouping set
            bar = bars.get(minute)
            if bar is None:  # the partial minute at the window's start
                bar = bars.setdefault(minute, MinuteBar(minute))
            setattr(bar, status, getattr(bar, status) + count)
            board.finished += count
            board.within_slo += within
            board.cancelled_unstarted += cancelled
            if status == Status.DONE:
                board.done += count
            else:
                board.failed += count
        else:  # the (queue, status) grouping set
            r = row(queue)
            setattr(r, status, getattr(r, status) + count)
    percentiles = replica.fetch(*queries["latency"])[0][4]
    if percentiles:
        board.latency_p50, board.latency_p95, board.latency_p99 = (
            float(p) if p is not None else None for p in percentiles
        )
    consumers = selectors.consumer_counts(replica.fetch(*queries["consumers"]))
    for r in rows.values():
        r.consumers = consumers(r.queue)
    board.paused = [rows.get(name, QueueRow(name)) for name in selectors.paused_queues()]
    for r in board.paused:
        r.paused = True
    board.queues = sorted(rows.values(), key=lambda r: r.queue)
    board.minutes = [bars[k] for k in sorted(bars)][-max(window_seconds // 60, 1) :]
    totals = QueueRow("all")
    for r in board.queues:
        for name in (*Status, "queued_due", "stuck"):  # a count per state, and two more
            setattr(totals, name, getattr(totals, name) + getattr(r, name))
    totals.oldest_due_seconds = board.oldest_due_seconds
    board.totals = totals
    return board


def cached_dashboard(ttl: int = DASHBOARD_CACHE_SECONDS) -> Dashboard:
    """The dashboard, recomputed at most every `ttl` seconds per cache."""
    key = (
        f"jobs:dashboard:{DASHBOARD_WINDOW_SECONDS}:"
        f"{settings.JOBS_LEASE_SECONDS}:{settings.JOBS_SLO_SECONDS}"
    )
    with replica.reads():  # a report: the replica's lag is within its bound
        return cache.get_or_set(key, dashboard, ttl)


def state_bars(board: Dashboard) -> list[dict[str, Any]]:
    """Horizontal bars for the state counts, scaled to the largest."""
    counts = board.state_counts
    top = max(counts.values(), default=0) or 1
    bars = []
    for label, count in counts.items():
        state = label.split(" ")[0]  # "done (window)" → "done"
        bars.append(
            {
                "label": label,
                "count": count,
                "percent": round(100 * count / top, 1),
                "status": state,
            }
        )
    return bars


def throughput_chart(board: Dashboard, width: int = 720, height: int = 140) -> dict[str, Any]:
    """Stacked per-minute bars (done below, failed on top) as SVG rectangles."""
    minutes = board.minutes
    n = max(len(minutes), 1)
    top = max((m.total for m in minutes), default=0) or 1
    slot = width / n
    bars = []
    for i, m in enumerate(minutes):
        h_done = height * m.done / top
        h_failed = height * m.failed / top
        bars.append(
            {
                "x": round(i * slot + 1, 2),
                "w": round(max(slot - 2, 1), 2),
                "done_y": round(height - h_done, 2),
                "done_h": round(h_done, 2),
                "failed_y": round(height - h_done - h_failed, 2),
                "failed_h": round(h_failed, 2),
                "label": f"{m.minute:%H:%M} UTC: {m.done} done, {m.failed} failed",
            }
        )
    return {"width": width, "height": height, "bars": bars, "max": top}


def kafka_sink() -> dict[str, Any] | None:
    """The Kafka sink's state (None when it is off): where it produces and, for each of
    its cursors (the history's and the domain events'), whether a reaper relays yet and
    how far behind the broker's acknowledgements are."""
    if not kafka.configured():
        return None
    rows = {r.subscriber: r for r in lag()}
    cursors = []
    for source, label in ((HISTORY, "job events"), (DOMAIN, "domain events")):
        name = kafka.KafkaSink.name + source.suffix
        row = rows.get(name)
        cursors.append({
            "label": label,
            "name": name,
            "relaying": row is not None,
            "behind": row.events if row else None,
            "oldest_seconds": row.seconds if row else None,
            "last_id": row.last_id if row else None,
            "updated_at": row.updated_at if row else None,
        })  # fmt: skip
    return {"topic": kafka.topic(), "servers": settings.JOBS_KAFKA_BOOTSTRAP_SERVERS,
            "cursors": cursors}  # fmt: skip


def dashboard_view(modeladmin: admin.ModelAdmin, request: HttpRequest) -> TemplateResponse:
    """The page: cached figures, bars and chart, for staff who may view jobs."""
    if not modeladmin.has_view_permission(request):
        raise PermissionDenied
    board = cached_dashboard()
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": _("Job dashboard"),
        "opts": modeladmin.opts,
        "board": board,
        "chart": throughput_chart(board),
        "state_bars": state_bars(board),
        "slo_target": SLO_TARGET,
        "window_minutes": board.window_seconds // 60,
        "slo_percent": percent(board.attainment),
        "success_percent": percent(board.success_rate),
        "changelist_url": reverse("admin:jobs_job_changelist"),
        "webhooks": webhooks.failure_rates(),
        "kafka": kafka_sink(),
        "deliveries_url": reverse("admin:jobs_webhookdelivery_changelist"),
    }
    return TemplateResponse(request, "admin/jobs/job/dashboard.html", context)
