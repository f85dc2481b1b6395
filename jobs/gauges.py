"""The readings behind the gauges the reaper exports (jobs.collectors) and the queue
controls `manage.py queue` shows: depth and age by state, each queue's controls and
what they hold back, webhook circuits, the partitions' runway, jobs waiting by reason.
Each is one bounded statement (a partial index, the planner's estimate, the catalog),
cached by the scrape, so a /metrics scrape costs the same at 10M rows as at 10k.
"""

from __future__ import annotations

from dataclasses import dataclass

from jobs import replica
from jobs.conf import settings
from jobs.lifecycle import (
    BLOCKED_RUN_AT,
    NON_TERMINAL,
    TERMINAL,
    Status,
    WaitReason,
    hot_sql,
    sql_list,
)
from jobs.models import Job, Queue

T = Job._meta.db_table

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
        for status, queue, count, age in replica.fetch(DEPTH_SQL, [])
    ]


# Per queue with a row: its controls, processing rows (through job_processing_id_idx)
# and the starts its rate still counts (tokens left = rate_limit - starts). Depth per
# queue is jobs_depth's (DepthCollector).
QUEUE_STATE_SQL = f"""
SELECT q.name, q.paused, q.concurrency, q.rate_limit, q.rate_period,
       (SELECT count(*) FROM unnest(q.rate_starts) s
         WHERE s > now() - q.rate_period * interval '1 second'),
       coalesce(p.n, 0), q.fair, q.key_concurrency, q.key_rate_limit, q.key_rate_period
FROM {Queue._meta.db_table} q
LEFT JOIN (SELECT queue, count(*) AS n FROM {T} WHERE status = '{Status.PROCESSING}'
           GROUP BY queue) p ON p.queue = q.name
ORDER BY q.name"""


@dataclass(frozen=True, slots=True)
class QueueState:
    """A queue's controls and what they hold back right now (metrics, dashboard)."""

    name: str
    paused: bool
    concurrency: int | None
    rate_limit: int | None
    rate_period: int | None
    recent_starts: int
    processing: int
    fair: bool = False
    key_concurrency: int | None = None
    key_rate_limit: int | None = None
    key_rate_period: int | None = None

    @property
    def rate_tokens(self) -> int | None:
        """Starts the rate still allows in the current window."""
        return None if self.rate_limit is None else max(0, self.rate_limit - self.recent_starts)


def queue_states() -> list[QueueState]:
    return [QueueState(*r) for r in replica.fetch(QUEUE_STATE_SQL, [])]


# Enabled endpoints by stored breaker state: an open one past its wait is still "open"
# until a delivery sends its probe (jobs.events.circuit). A few rows per client at most.
WEBHOOK_CIRCUITS_SQL = """
SELECT circuit_state, count(*) FROM jobs_webhook WHERE enabled GROUP BY circuit_state
"""


def webhook_circuit_counts() -> dict[str, int]:
    """Enabled webhook endpoints per circuit state, every state present (0 when none)."""
    from jobs.models import CircuitState

    counts = dict.fromkeys(CircuitState.values, 0)
    counts.update(dict(replica.fetch(WEBHOOK_CIRCUITS_SQL, [])))
    return counts


# No count of the hot partition: the planner's estimate (ANALYZE, autovacuum) is free.
# The oldest finished job still hot comes from job_finished_idx; the runway is the upper
# bound of the newest history partition (past it, no job row can be written: D191);
# partitions a DETACH … CONCURRENTLY left pending are counted (D214).
PARTITIONS_SQL = f"""
SELECT (SELECT reltuples FROM pg_class WHERE oid = 'jobs_job_hot'::regclass),
       (SELECT EXTRACT(EPOCH FROM statement_timestamp() - min(finished_at))
        FROM jobs_job WHERE {hot_sql()} AND status IN ({sql_list(TERMINAL)})),
       (SELECT EXTRACT(EPOCH FROM max(substring(pg_get_expr(c.relpartbound, c.oid)
                                                FROM 'TO \\(''([^'']+)''\\)')::timestamptz)
                                  - statement_timestamp())
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'jobs_jobevent'::regclass),
       (SELECT count(*) FROM pg_inherits
        WHERE inhparent IN ('jobs_job'::regclass, 'jobs_jobevent'::regclass)
          AND inhdetachpending)
"""


@dataclass(frozen=True)
class PartitionState:
    hot_rows: float | None  # None: never analyzed
    oldest_hot_finished_age: float | None  # seconds; None: no finished job is hot
    runway: float | None  # seconds; None: no bounded history partition
    detach_pending: int = 0  # partitions no row is routed to until attached again


def partition_state() -> PartitionState:
    hot_rows, oldest, runway, pending = replica.fetch(PARTITIONS_SQL, [])[0]
    return PartitionState(
        None if hot_rows is None or hot_rows < 0 else float(hot_rows),
        None if oldest is None else float(oldest),
        None if runway is None else float(runway),
        int(pending),
    )


WAITING_SQL = f"""
SELECT wait_reason, count(*) FROM {T}
WHERE status = '{Status.QUEUED}' AND wait_reason IS NOT NULL GROUP BY wait_reason"""


def waiting_by_reason() -> dict[str, int]:
    """Queued jobs that are not due because they wait (parked, blocked), by reason:
    read through the partial index job_waiting_idx."""
    return dict(replica.fetch(WAITING_SQL, []))


# The largest history of a live durable run, and the parked signal waits with no
# timeout on runs older than JOBS_OPEN_WAIT_WARN_AGE (D319): one statement per scrape.
DURABLE_HISTORY_SQL = f"""
SELECT (SELECT coalesce(max(n), 0) FROM (
          SELECT count(*) AS n FROM jobs_jobstep s JOIN {T} j ON j.id = s.job_id
          WHERE j.status IN ('{Status.QUEUED}', '{Status.PROCESSING}') AND {hot_sql("j")}
          GROUP BY s.job_id) c),
       (SELECT coalesce(max(b), 0) FROM (
          SELECT sum(pg_column_size(s.result)) AS b FROM jobs_jobstep s
          JOIN {T} j ON j.id = s.job_id
          WHERE j.status IN ('{Status.QUEUED}', '{Status.PROCESSING}') AND {hot_sql("j")}
          GROUP BY s.job_id) c),
       (SELECT count(*) FROM {T} j
        WHERE j.status = '{Status.QUEUED}' AND j.wait_reason = '{WaitReason.SIGNAL}'
          AND j.run_at >= %(blocked)s AND j.created_at < now() - %(age)s * interval '1 second')"""


def durable_history_state() -> tuple[int, int, int]:
    """(most history rows of a live durable run, most stored bytes of one, signal waits
    with no timeout on runs older than JOBS_OPEN_WAIT_WARN_AGE)."""
    params = {"blocked": BLOCKED_RUN_AT, "age": float(settings.JOBS_OPEN_WAIT_WARN_AGE)}
    steps, size, open_waits = replica.fetch(DURABLE_HISTORY_SQL, params)[0]
    return int(steps), int(size), int(open_waits)
