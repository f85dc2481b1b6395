"""Admission: whether one more thing fits, asked before it is written. A job in its queue
(backpressure) and a client's schedules, webhooks and signals per job (quotas).

Backpressure has two limits (D198). A queue's depth, shared by everyone: past
JOBS_MAX_QUEUE_DEPTH queued jobs, only those due within JOBS_QUEUE_DEPTH_HORIZON count,
so parked work never refuses anybody. A client's share: at most its limit of queued jobs
(parked ones too) in one queue, refused to that client alone. Each reading is a bounded
count cached ~1 s per process; below both limits a submission costs the one count it
always did.

Quotas: a setting gives each default; a client's own column (set by staff in the admin)
replaces it for that client (the share of a queue's depth is one). A refusal is
QuotaExceeded (the depth's: ClientQueueFull), naming the limit, and writes nothing. The
check of a schedule, webhook or signal runs in the transaction of the write it guards,
after locking the client's row (or, for signals, the job's row, which deliver_signal
locks first): two requests racing for the last place are taken one after the other, so
the limit holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection

from jobs import metrics
from jobs.conf import settings
from jobs.exceptions import ClientQueueFull, QueueFull, QuotaExceeded
from jobs.lifecycle import Status
from jobs.models import Client, Job

# --- quotas ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Quota:
    what: str  # in the message: "schedules", "webhooks", "signals per job"
    column: str  # jobs_client's override
    setting: str
    default: int
    count_sql: str


SCHEDULES = Quota("schedules", "max_schedules", "JOBS_MAX_SCHEDULES", 100,
                  "SELECT count(*) FROM jobs_schedule WHERE client_id = %s")  # fmt: skip
WEBHOOKS = Quota("webhooks", "max_webhooks", "JOBS_MAX_WEBHOOKS", 10,
                 "SELECT count(*) FROM jobs_webhook WHERE client_id = %s")  # fmt: skip
# Per queue: counted below (bounded, cached), refused as ClientQueueFull.
QUEUE_DEPTH = Quota("queued jobs per queue", "max_queue_depth", "JOBS_MAX_CLIENT_QUEUE_DEPTH",
                    10_000, "")  # fmt: skip
SIGNALS_PER_JOB = Quota("signals per job", "max_signals_per_job", "JOBS_MAX_SIGNALS_PER_JOB", 20,
                        "SELECT count(*) FROM jobs_jobsignal WHERE job_id = %s")  # fmt: skip

_LIMIT_SQL = "SELECT {column} FROM jobs_client WHERE id = %s"
_LOCKED_LIMIT_SQL = _LIMIT_SQL + " FOR NO KEY UPDATE"


def quota_default(quota: Quota) -> int:
    return int(getattr(settings, quota.setting))


def quota_limit(quota: Quota, client_id: int | None, *, lock: bool = False) -> int:
    """The client's limit (its column, else the setting); `lock` holds its row until
    the transaction ends, so a concurrent check of the same client waits."""
    if client_id is None:
        return quota_default(quota)
    sql = (_LOCKED_LIMIT_SQL if lock else _LIMIT_SQL).format(column=quota.column)
    with connection.cursor() as cur:
        cur.execute(sql, [client_id])
        row = cur.fetchone()
    return quota_default(quota) if row is None or row[0] is None else row[0]


def check_quota(quota: Quota, client_id: int | None, counted_id: int | None = None) -> None:
    """Raise QuotaExceeded unless one more fits: `counted_id` is what the count is
    per (the client, or the job for signals). Call inside the guarded write's
    transaction; client rows are locked here, a job's by its caller."""
    allowed = quota_limit(quota, client_id, lock=counted_id is None)
    with connection.cursor() as cur:
        cur.execute(quota.count_sql, [client_id if counted_id is None else counted_id])
        held = cur.fetchone()[0]
    if held >= allowed:
        raise QuotaExceeded(
            f"quota exceeded: at most {allowed} {quota.what}"
            + ("" if counted_id is not None else " per client")
            + f" (holds {held}); delete one or ask staff to raise the limit",
            field=None,
        )


# --- backpressure ---------------------------------------------------------------------

DEPTH_CACHE_SECONDS = 1.0  # how long a queue-depth reading is trusted
_depth_lock = threading.Lock()
_depth_cache: dict[tuple, tuple[int, float]] = {}
_J = Job._meta.db_table
_DEPTH_SQL = (
    f"SELECT count(*) FROM (SELECT 1 FROM {_J} "
    f"WHERE status = '{Status.QUEUED}' AND queue = %s LIMIT %s) AS bounded"
)
# job_claim_idx holds run_at: the walk stays in the index.
_DUE_DEPTH_SQL = (
    f"SELECT count(*) FROM (SELECT 1 FROM {_J} WHERE status = '{Status.QUEUED}' AND queue = %s "
    "AND run_at <= now() + make_interval(secs => %s) LIMIT %s) AS bounded"
)
# job_fair_claim_idx: (queue, COALESCE(client_id, 0), ...) WHERE status = 'queued'.
_CLIENT_DEPTH_SQL = (
    f"SELECT count(*) FROM (SELECT 1 FROM {_J} WHERE status = '{Status.QUEUED}' AND queue = %s "
    "AND COALESCE(client_id, 0) = %s LIMIT %s) AS bounded"
)
# The lowest share any client has: below it, no client's own count is needed.
_LOWEST_SHARE_SQL = "SELECT min(max_queue_depth) FROM jobs_client"


def _cached_count(key: tuple, sql: str, params: list[Any]) -> int:
    now = time.monotonic()
    with _depth_lock:
        cached = _depth_cache.get(key)
        if cached is not None and cached[1] > now:
            return cached[0]
    with connection.cursor() as cur:
        cur.execute(sql, params)
        value = cur.fetchone()[0]
    with _depth_lock:
        _depth_cache[key] = (value, now + DEPTH_CACHE_SECONDS)
    return value


def queue_depth(queue: str, limit: int) -> int:
    """Queued jobs in `queue` as backpressure counts them, up to `limit` + 1: all of them
    while they are at most `limit`, else those due within JOBS_QUEUE_DEPTH_HORIZON.

    Each bounded count walks at most limit + 1 entries of the partial index job_claim_idx
    (past the limit, the parked entries too), cached ~1 s per process.
    """
    depth = _cached_count(("all", queue), _DEPTH_SQL, [queue, limit + 1])
    if depth <= limit:
        return depth
    horizon = float(settings.JOBS_QUEUE_DEPTH_HORIZON)
    return _cached_count(("due", queue), _DUE_DEPTH_SQL, [queue, horizon, limit + 1])


def _lowest_share() -> int:
    default = quota_default(QUEUE_DEPTH)
    lowest = _cached_count(("lowest share",), _LOWEST_SHARE_SQL, [])
    return default if lowest is None else min(default, lowest)


def check_share(queue: str, client: Client | None, new: int) -> None:
    """ClientQueueFull when `new` more jobs would take the client past its share of
    `queue` (code without a client has none). The client's own count is read only when
    the whole queue holds more than the lowest share any client has."""
    if client is None or new <= 0:
        return
    limit = settings.JOBS_MAX_QUEUE_DEPTH
    depth = _cached_count(("all", queue), _DEPTH_SQL, [queue, limit + 1])
    if depth <= limit and depth + new <= _lowest_share():
        return
    share = quota_limit(QUEUE_DEPTH, client.pk)
    held = _cached_count(("client", queue, client.pk), _CLIENT_DEPTH_SQL,
                         [queue, client.pk, share + 1])  # fmt: skip
    if held + new > share:
        raise ClientQueueFull(queue, held, share)


def _count_accepted(queue: str, n: int = 1, client_id: int | None = None) -> None:
    """Keep this process's cached readings current between refreshes."""
    with _depth_lock:
        for key in (("all", queue), ("due", queue), ("client", queue, client_id)):
            cached = _depth_cache.get(key)
            if cached is not None:
                _depth_cache[key] = (cached[0] + n, cached[1])


def due_soon(run_at: datetime | None) -> bool:
    """A job due within JOBS_QUEUE_DEPTH_HORIZON counts toward the shared depth."""
    horizon = timedelta(seconds=float(settings.JOBS_QUEUE_DEPTH_HORIZON))
    return run_at is None or run_at <= datetime.now(UTC) + horizon


def admit(queue: str, client: Client | None, run_at: datetime | None) -> None:
    """The room for one job, asked once: QueueFull when `queue` holds more than
    JOBS_MAX_QUEUE_DEPTH and the job is due within the horizon, ClientQueueFull when it
    would take the client past its share."""
    limit = settings.JOBS_MAX_QUEUE_DEPTH
    depth = queue_depth(queue, limit)
    if depth > limit and due_soon(run_at):
        raise QueueFull(queue, depth, limit)
    check_share(queue, client, 1)


def check_room(
    per_queue: Mapping[str, int],
    new_per_queue: Callable[[], Mapping[str, int]],
    client: Client | None = None,
    due_per_queue: Mapping[str, int] | None = None,
) -> None:
    """Backpressure for many jobs at once (a batch, a workflow): QueueFull for the first
    queue its due jobs (`due_per_queue`, default all) would take past JOBS_MAX_QUEUE_DEPTH,
    ClientQueueFull for the first its jobs would take past the client's share, counting
    every job refused. `new_per_queue` (the jobs that are not replays) is asked only when
    a queue is near full; a refusal writes nothing."""
    limit = settings.JOBS_MAX_QUEUE_DEPTH
    due = per_queue if due_per_queue is None else due_per_queue
    over = [q for q, n in due.items() if n and queue_depth(q, limit) + n > limit]
    new: Mapping[str, int] | None = None
    for queue in over:
        new = new_per_queue() if new is None else new
        depth = queue_depth(queue, limit)
        adding = min(new.get(queue, 0), due[queue])
        if adding and depth + adding > limit:
            metrics.SUBMISSIONS_REJECTED.labels(queue, QueueFull.code).inc(sum(per_queue.values()))
            raise QueueFull(queue, depth, limit)
    if client is None:
        return
    try:
        for queue, n in per_queue.items():
            try:
                check_share(queue, client, n)
            except ClientQueueFull:
                new = new_per_queue() if new is None else new
                check_share(queue, client, new.get(queue, 0))
    except ClientQueueFull as exc:
        metrics.SUBMISSIONS_REJECTED.labels(exc.queue, exc.code).inc(sum(per_queue.values()))
        raise


def count_accepted(per_queue: Mapping[str, int], client_id: int | None = None) -> None:
    for queue, n in per_queue.items():
        _count_accepted(queue, n, client_id)


def clear_depth_cache() -> None:
    with _depth_lock:
        _depth_cache.clear()
