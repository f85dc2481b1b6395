"""Backpressure: whether a queue, and a client's share of it, has room for more jobs.

Two limits (D198). A queue's depth, shared by everyone: past JOBS_MAX_QUEUE_DEPTH queued
jobs, only those due within JOBS_QUEUE_DEPTH_HORIZON count, so parked work never refuses
anybody. A client's share: at most its limit of queued jobs (parked ones too) in one
queue, refused to that client alone. Each reading is a bounded count cached ~1 s per
process; below both limits a submission costs the one count it always did.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection

from jobs import metrics, quotas
from jobs.conf import settings
from jobs.exceptions import ClientQueueFull, QueueFull
from jobs.lifecycle import Status
from jobs.models import Client, Job

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
    default = quotas.default(quotas.QUEUE_DEPTH)
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
    share = quotas.limit(quotas.QUEUE_DEPTH, client.pk)
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
