"""Time partitions of jobs_job and jobs_jobevent, and the mover (issue 33, D155-D166).

Live jobs and recently finished ones are in jobs_job_hot (period 'infinity'). The
reaper calls `maintain()` on every sweep: it creates the partitions of the current
and next periods ahead, and moves jobs finished more than JOBS_HOT_FINISHED_SECONDS
ago to the partition of their created_at's period, in bounded batches, creating a
past period's partition when a job needs it (the legacy rows of the migration go
the same way, over time). A move changes `period` only: no history row, no lease
bump, updated_at unchanged (the guard lets it through, D157).

A partition left "detach pending" by an interrupted `DETACH … CONCURRENTLY` is neither
routed to nor read through its parent: the reaper attaches it again (D214).
"""

from __future__ import annotations

import logging
import re
import time
from datetime import UTC, date, datetime, timedelta

from django.db import OperationalError, connection, transaction

from jobs import lifecycle, metrics
from jobs.conf import settings
from jobs.lifecycle import TERMINAL

log = logging.getLogger(__name__)

PERIODS = ("day", "week", "month")
JOBS = "jobs_job"
EVENTS = "jobs_jobevent"
# Serialises partition creation between reapers (an advisory lock of its own).
_LOCK_KEY = 0x6A6F6273_70617274  # "jobspart"
# Held by the archiving run (jobs.archive.tables.archiving) for its whole run.
ARCHIVING_LOCK_KEY = 0x6A6F6273_61726368  # "jobsarch"
_NAME = re.compile(r"jobs_job(event)?_p\d{8}")
_BOUND = re.compile(r"TO \('(\d{4}-\d{2}-\d{2})")


def unit() -> str:
    period = settings.JOBS_PARTITION_PERIOD
    if period not in PERIODS:
        raise ValueError(f"JOBS_PARTITION_PERIOD must be one of {', '.join(PERIODS)}")
    return period


def period_start(at: datetime | date) -> date:
    """The first day of the period `at` (UTC) falls in."""
    day = at.astimezone(UTC).date() if isinstance(at, datetime) else at
    period = unit()
    if period == "week":
        return day - timedelta(days=day.weekday())
    if period == "month":
        return day.replace(day=1)
    return day


def next_start(start: date) -> date:
    period = unit()
    if period == "week":
        return start + timedelta(days=7)
    if period == "month":
        return (start + timedelta(days=32)).replace(day=1)
    return start + timedelta(days=1)


def partition_name(table: str, start: date) -> str:
    return f"{table}_p{start:%Y%m%d}"


def _period_sql(column: str) -> str:
    """SQL for the period start of a timestamptz column (UTC), as period_start()."""
    return f"date_trunc('{unit()}', {column} AT TIME ZONE 'UTC')::date"


def _existing(cur) -> set[str]:
    cur.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent IN (%s::regclass, %s::regclass)",
        [JOBS, EVENTS],
    )
    return {r[0] for r in cur.fetchall()}


def _unavailable(cur, table: str) -> set[str]:
    """Partition names the mover must not create or move to: a table of that name that
    is not attached (a period being archived, or one a crashed prune left detached) or
    whose detach is pending (no row is routed to it), or a period archived and not
    restored. Its jobs stay hot until the period is back."""
    cur.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "LEFT JOIN pg_inherits i ON i.inhrelid = c.oid "
        "WHERE n.nspname = current_schema() AND c.relkind = 'r' "
        "AND (NOT c.relispartition OR i.inhdetachpending) AND c.relname LIKE %s",
        [f"{table}\\_p%"],
    )
    names = {r[0] for r in cur.fetchall() if _NAME.fullmatch(r[0])}
    cur.execute("SELECT to_regclass('jobs_archivedperiod') IS NOT NULL")
    if cur.fetchone()[0]:
        cur.execute("SELECT period FROM jobs_archivedperiod WHERE restored_at IS NULL")
        names |= {partition_name(table, r[0]) for r in cur.fetchall()}
    return names


def legacy_bound(cur) -> date | None:
    """Where jobs_jobevent_legacy ends: history partitions start there."""
    cur.execute(
        "SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_class c "
        "WHERE c.relname = 'jobs_jobevent_legacy' AND c.relispartition"
    )
    row = cur.fetchone()
    match = _BOUND.search(row[0]) if row else None
    return date.fromisoformat(match.group(1)) if match else None


def _create(cur, table: str, start: date) -> None:
    """A new empty table shaped like the parent, attached: ATTACH takes SHARE UPDATE
    EXCLUSIVE on the parent (reads and writes go on), unlike CREATE ... PARTITION OF."""
    name, end = partition_name(table, start), next_start(start)
    if table == EVENTS:
        low, high = f"'{start} 00:00:00+00'", f"'{end} 00:00:00+00'"
    else:
        low, high = f"'{start}'", f"'{end}'"
    cur.execute(f"CREATE TABLE {name} (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
    cur.execute(f"ALTER TABLE {name} ADD PRIMARY KEY (id)")
    cur.execute(f"ALTER TABLE {table} ATTACH PARTITION {name} FOR VALUES FROM ({low}) TO ({high})")
    log.info("partition %s created", name)


def _lock_timeout(cur) -> None:
    """DDL on a partitioned table waits at most JOBS_PARTITION_LOCK_TIMEOUT (this
    transaction): a lock not granted is left for the next sweep."""
    cur.execute(
        "SET LOCAL lock_timeout = %s", [f"{int(settings.JOBS_PARTITION_LOCK_TIMEOUT * 1000)}ms"]
    )


def ensure(periods: dict[str, set[date]]) -> set[tuple[str, date]]:
    """Create the partitions missing among `periods` ({table: {period start}}); returns
    those that exist afterwards. A partition whose parent lock is not granted within
    JOBS_PARTITION_LOCK_TIMEOUT is left for the next sweep."""
    ready: set[tuple[str, date]] = set()
    with connection.cursor() as cur:
        existing = _existing(cur)
        bound = legacy_bound(cur) if periods.get(EVENTS) else None
        unavailable = {t: _unavailable(cur, t) for t in periods}
    for table in (JOBS, EVENTS):
        for start in sorted(periods.get(table, ())):
            if table == EVENTS and (bound is None or start < bound):
                continue  # the legacy partition holds these
            if partition_name(table, start) in unavailable[table]:
                log.warning(
                    "partition %s is detached, detach pending or archived: its jobs stay hot",
                    partition_name(table, start),
                )
                continue
            if partition_name(table, start) in existing:
                ready.add((table, start))
                continue
            try:
                with transaction.atomic(), connection.cursor() as cur:
                    _lock_timeout(cur)
                    cur.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK_KEY])
                    if partition_name(table, start) not in _existing(cur):
                        _create(cur, table, start)
                ready.add((table, start))
            except OperationalError as exc:  # lock_timeout: next sweep
                log.warning("partition %s not created yet: %s", partition_name(table, start), exc)
    return ready


def ensure_ahead(now: datetime | None = None) -> set[tuple[str, date]]:
    """The current period and JOBS_PARTITION_AHEAD next ones, for jobs and history."""
    start = period_start(now or datetime.now(UTC))
    starts = {start}
    for _ in range(settings.JOBS_PARTITION_AHEAD):
        start = next_start(start)
        starts.add(start)
    return ensure({JOBS: starts, EVENTS: starts})


_CANDIDATES_SQL = f"""
SELECT id, {{period}} FROM {JOBS}
WHERE {lifecycle.hot_sql()} AND status IN ({lifecycle.sql_list(TERMINAL)})
  AND finished_at <= statement_timestamp() - %s * interval '1 second'
  AND {{period}} <> ALL(%s::date[])
ORDER BY finished_at
LIMIT %s"""

_MOVE_SQL = f"""
UPDATE {JOBS} j SET period = {{period}}
WHERE j.id = ANY(%s) AND {lifecycle.hot_sql("j")}
  AND j.status IN ({lifecycle.sql_list(TERMINAL)})
  AND j.id IN (SELECT id FROM {JOBS} WHERE id = ANY(%s) AND {lifecycle.hot_sql()}
               FOR UPDATE SKIP LOCKED)"""


def move_batch(hot_seconds: float | None = None, batch: int | None = None) -> int:
    """Move one batch of jobs finished more than `hot_seconds` ago to their cold
    partitions; returns how many moved. Rows another transaction holds are skipped."""
    hot_seconds = settings.JOBS_HOT_FINISHED_SECONDS if hot_seconds is None else hot_seconds
    batch = settings.JOBS_PARTITION_MOVE_BATCH if batch is None else batch
    period = _period_sql("created_at")
    with connection.cursor() as cur:
        # Jobs of a detached or archived period wait hot, without stalling the rest.
        skipped = sorted(
            date.fromisoformat(f"{m[-8:-4]}-{m[-4:-2]}-{m[-2:]}") for m in _unavailable(cur, JOBS)
        )
        cur.execute(_CANDIDATES_SQL.format(period=period), [hot_seconds, skipped, batch])
        rows = cur.fetchall()
    if not rows:
        return 0
    ready = ensure({JOBS: {p for _, p in rows}})
    ids = [i for i, p in rows if (JOBS, p) in ready]
    if not ids:
        return 0
    with connection.cursor() as cur:
        cur.execute(_MOVE_SQL.format(period=_period_sql("j.created_at")), [ids, ids])
        moved = cur.rowcount
    metrics.PARTITION_MOVED.inc(moved)
    return moved


_PENDING_SQL = f"""
SELECT i.inhparent::regclass::text, c.relname, pg_get_expr(c.relpartbound, c.oid)
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent IN ('{JOBS}'::regclass, '{EVENTS}'::regclass) AND i.inhdetachpending
ORDER BY 1, 2"""


def detach_pending() -> list[tuple[str, str, str]]:
    """(parent, partition, bound) of each partition whose DETACH … CONCURRENTLY did not
    finish (at most one per parent)."""
    with connection.cursor() as cur:
        cur.execute(_PENDING_SQL)
        return cur.fetchall()


def attach_pending_detaches() -> int:
    """Put back each partition an interrupted DETACH … CONCURRENTLY left pending: rows of
    its period cannot be written (PostgreSQL routes none to it) nor read through the
    parent. FINALIZE and ATTACH with the bound it had, in one transaction under
    JOBS_PARTITION_LOCK_TIMEOUT (FINALIZE waits for older snapshots: a long transaction
    leaves it for the next sweep). A running prunejobs holds the archiving lock and
    finishes its own detach. Returns how many were attached again (D214)."""
    attached = 0
    for parent, table, bound in detach_pending():
        log.warning("partition %s of %s is detach pending: attaching it again", table, parent)
        try:
            with transaction.atomic(), connection.cursor() as cur:
                _lock_timeout(cur)
                cur.execute("SELECT pg_try_advisory_xact_lock(%s)", [ARCHIVING_LOCK_KEY])
                if not cur.fetchone()[0]:
                    log.info("prunejobs is archiving: it finishes the detach of %s", table)
                    continue
                cur.execute(_PENDING_SQL)  # under the lock: still pending, same bound?
                if (parent, table, bound) not in cur.fetchall():
                    continue
                # The bound check the detach added stays: ATTACH skips its scan with it.
                cur.execute(f"ALTER TABLE {parent} DETACH PARTITION {table} FINALIZE")
                cur.execute(f"ALTER TABLE {parent} ATTACH PARTITION {table} {bound}")
        except OperationalError as exc:  # lock_timeout: an older snapshot is still open
            log.warning("partition %s still detach pending: %s", table, exc)
            continue
        attached += 1
        log.info("partition %s attached again to %s", table, parent)
    return attached


def maintain(*, max_batches: int = 10) -> int:
    """The reaper's share: partitions a detach left pending attached again, partitions
    ahead (at most once a minute), then up to `max_batches` batches of moves; returns
    how many jobs moved."""
    global _ahead_at
    attach_pending_detaches()
    if time.monotonic() - _ahead_at > 60:
        ensure_ahead()
        _ahead_at = time.monotonic()
    moved = 0
    for _ in range(max_batches):
        n = move_batch()
        moved += n
        if n < settings.JOBS_PARTITION_MOVE_BATCH:
            break
    if moved:
        log.info("moved %d finished job(s) to their cold partitions", moved)
    return moved


_ahead_at = float("-inf")
