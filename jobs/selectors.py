"""Reads. Cheap, index-served queries for the reaper, the SLO report and dashboards."""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connection

from jobs.models import Job

T = Job._meta.db_table


def _rows(sql: str, params: list | dict) -> list[tuple]:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def db_now():
    """The database clock, which decides everything (SPEC §1)."""
    return _rows("SELECT now()", [])[0][0]


def came_due(since, until, limit: int) -> list[tuple[int, str]]:
    """Queued jobs whose run_at passed in (since, until] and lay in the future when the
    row was last written (scheduled or backed off): nobody signalled them when due."""
    return _rows(
        f"""SELECT id, queue FROM {T}
            WHERE status = 'queued' AND run_at > %s AND run_at <= %s
              AND run_at > updated_at
            ORDER BY run_at LIMIT %s""",
        [since, until, limit],
    )


def waiting_too_long(
    queues: list[str] | None, older_than: float, limit: int
) -> list[tuple[int, str]]:
    """Due queued jobs untouched for `older_than` seconds: their signal may be lost."""
    queue_clause = "AND queue = ANY(%(queues)s)" if queues is not None else ""
    return _rows(
        f"""SELECT id, queue FROM {T}
            WHERE status = 'queued' {queue_clause}
              AND run_at <= now() - %(age)s * interval '1 second'
              AND updated_at <= now() - %(age)s * interval '1 second'
            ORDER BY priority DESC, run_at, id LIMIT %(limit)s""",
        {"queues": queues, "age": older_than, "limit": limit},
    )


def queued_queues() -> list[str]:
    """Queues that have queued jobs (a loose index scan over the partial claim index)."""
    return [
        r[0]
        for r in _rows(
            f"""WITH RECURSIVE q AS (
                  (SELECT queue FROM {T} WHERE status = 'queued' ORDER BY queue LIMIT 1)
                  UNION ALL
                  SELECT (SELECT queue FROM {T} WHERE status = 'queued' AND queue > q.queue
                          ORDER BY queue LIMIT 1) FROM q WHERE q.queue IS NOT NULL)
                SELECT queue FROM q WHERE queue IS NOT NULL""",
            [],
        )
    ]


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


def slo_report(window_seconds: float, slo_seconds: float) -> SloReport:
    """Submission → terminal latency over jobs finished in the window (failures counted)."""
    row = _rows(
        f"""SELECT count(*),
                   count(*) FILTER (WHERE finished_at - created_at
                                    <= %(slo)s * interval '1 second'),
                   count(*) FILTER (WHERE status = 'done'),
                   count(*) FILTER (WHERE status = 'failed'),
                   percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP
                     (ORDER BY extract(epoch FROM finished_at - created_at))
            FROM {T}
            WHERE finished_at >= now() - %(window)s * interval '1 second'""",
        {"slo": slo_seconds, "window": window_seconds},
    )[0]
    pct = row[4] or [None, None, None]
    return SloReport(window_seconds, slo_seconds, row[0], row[1], row[2], row[3], *pct)
