"""The PostgreSQL side of retention by partition: which periods exist and in what
state, and the DDL that detaches, checks, drops and re-attaches them.

A period is named by the day it starts: `jobs_job_pYYYYMMDD` (its finished jobs, range
on `period`) and `jobs_jobevent_pYYYYMMDD` (their history, range on `job_created_at`).
`DETACH … CONCURRENTLY` and `… FINALIZE` cannot run inside a transaction block, so they
go through a connection of their own in autocommit; everything else uses Django's.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO

import psycopg
from django.db import connection, transaction

from jobs.archive.files import INFINITY, Column, select_list
from jobs.lifecycle import TERMINAL
from jobs.partitions import ARCHIVING_LOCK_KEY

JOBS = "jobs_job"
EVENTS = "jobs_jobevent"
HOT = "jobs_job_hot"
LEGACY = "jobs_jobevent_legacy"
_PERIOD_TABLE = re.compile(r"^jobs_job_p(\d{8})$")
_BOUND = re.compile(r"FROM \('([^']+)'\) TO \('([^']+)'\)")
_CHECK_BOUND = re.compile(r"period >= '([0-9-]+)'::date\) AND \(period < '([0-9-]+)'::date")

# Rows of other tables that belong to a period's jobs: archived with them and deleted
# when the period is dropped (what row-wise retention deletes with a job). The name is
# the table and the file; the condition selects the rows of the jobs in {jobs}.
SIDE_TABLES: dict[str, str] = {
    LEGACY: "job_id IN (SELECT id FROM {jobs})",
    "jobs_jobstep": "job_id IN (SELECT id FROM {jobs})",
    "jobs_jobsignal": "job_id IN (SELECT id FROM {jobs})",
    "jobs_workflownode": "job_id IN (SELECT id FROM {jobs})",
    "jobs_jobdependency": (
        "child_id IN (SELECT id FROM {jobs}) OR parent_id IN (SELECT id FROM {jobs})"
    ),
    # A webhook delivery goes with its delivery job (jobs.events): its status was the job's.
    "jobs_webhookdelivery": "job_id IN (SELECT id FROM {jobs})",
}
# The order each file is written in: what `archive show` filters on is sorted (the
# others go in primary key order).
ORDER = {JOBS: "id", EVENTS: "job_id, id", LEGACY: "job_id, id"}


def job_table(period: datetime.date) -> str:
    return f"{JOBS}_p{period:%Y%m%d}"


def event_table(period: datetime.date) -> str:
    return f"{EVENTS}_p{period:%Y%m%d}"


@dataclass(frozen=True)
class Partition:
    period: datetime.date
    attached: bool
    detach_pending: bool  # a DETACH … CONCURRENTLY that did not finish
    start: datetime.date | None = None
    end: datetime.date | None = None

    @property
    def jobs(self) -> str:
        return job_table(self.period)

    @property
    def events(self) -> str:
        return event_table(self.period)


def _rows(sql: str, params: Any = None) -> list[tuple]:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def exists(table: str) -> bool:
    return _rows("SELECT to_regclass(%s) IS NOT NULL", [table])[0][0]


def partitions() -> list[Partition]:
    """Every cold period table of jobs_job, attached or not, oldest first."""
    found = []
    for name, parent, pending, bound, check in _rows(
        """SELECT c.relname, i.inhparent::regclass::text, i.inhdetachpending,
                  pg_get_expr(c.relpartbound, c.oid),
                  (SELECT pg_get_constraintdef(k.oid) FROM pg_constraint k
                   WHERE k.conrelid = c.oid AND k.contype = 'c'
                     AND k.conname = c.relname || '_period_check')
           FROM pg_class c LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
           WHERE c.relkind IN ('r', 'p') AND c.relnamespace = current_schema()::regnamespace
             AND c.relname ~ '^jobs_job_p[0-9]{8}$'
           ORDER BY c.relname"""
    ):
        m = _PERIOD_TABLE.match(name)
        if not m:
            continue
        period = datetime.datetime.strptime(m.group(1), "%Y%m%d").date()
        bounds = _BOUND.search(bound or "") or _CHECK_BOUND.search(check or "")
        start, end = (
            (datetime.date.fromisoformat(b) for b in bounds.groups()) if bounds else (None, None)
        )
        found.append(Partition(period, parent == JOBS and not pending, bool(pending), start, end))
    return found


def period_start_utc(day: datetime.date) -> datetime.datetime:
    return datetime.datetime.combine(day, datetime.time(), tzinfo=datetime.UTC)


def held_back(p: Partition, cutoff: datetime.datetime) -> str | None:
    """Why an attached period whose end is past `cutoff` must stay, or None: a job
    created in it is still hot (live, or finished and not moved yet), or one of its
    jobs finished after the cutoff."""
    hot = still_hot(p)
    if hot:
        return f"{hot} jobs created in it are still in {HOT}"
    late = _rows(f"SELECT count(*) FROM {p.jobs} WHERE finished_at >= %s", [cutoff])[0][0]
    if late:
        return f"{late} of its jobs finished after the cutoff"
    return None


def still_hot(p: Partition) -> int:
    """Jobs created in the period that are in jobs_job_hot (live, not moved yet, or
    brought back by a staff retry)."""
    start, end = period_start_utc(p.start), period_start_utc(p.end)
    return _rows(
        f"SELECT count(*) FROM {HOT} WHERE created_at >= %s AND created_at < %s", [start, end]
    )[0][0]


# One archiving run at a time (a session advisory lock of its own); the reaper takes it
# too before it attaches a partition a detach left pending (D214).
_LOCK_KEY = ARCHIVING_LOCK_KEY


@contextmanager
def archiving() -> Iterator[bool]:
    """Whether this session holds the archiving lock (not waited for), held inside."""
    got = _rows("SELECT pg_try_advisory_lock(%s)", [_LOCK_KEY])[0][0]
    try:
        yield got
    finally:
        if got:
            _rows("SELECT pg_advisory_unlock(%s)", [_LOCK_KEY])


@contextmanager
def autocommit() -> Iterator[psycopg.Connection]:
    """A connection of its own, outside any transaction of Django's."""
    connection.ensure_connection()
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    conn = psycopg.connect(**params, autocommit=True)
    try:
        yield conn
    finally:
        conn.close()


def detach(p: Partition) -> None:
    """DETACH … CONCURRENTLY the period's two tables (writers are never blocked); a
    detach left pending by a crash is finished with FINALIZE instead."""
    with autocommit() as conn:
        for parent, table in ((JOBS, p.jobs), (EVENTS, p.events)):
            state = conn.execute(
                """SELECT i.inhdetachpending FROM pg_inherits i
                   WHERE i.inhrelid = to_regclass(%s) AND i.inhparent = to_regclass(%s)""",
                [table, parent],
            ).fetchone()
            if state is None:
                continue  # already detached, or no history table for this period
            how = "FINALIZE" if state[0] else "CONCURRENTLY"
            conn.execute(f"ALTER TABLE {parent} DETACH PARTITION {table} {how}")


def columns(table: str) -> list[Column]:
    return [
        Column(name, pg_type)
        for name, pg_type in _rows(
            """SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute
               WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped
               ORDER BY attnum""",
            [table],
        )
    ]


def primary_key(table: str) -> str:
    """The primary key's column(s), comma-separated: the order of its file and what a
    restore skips when already there."""
    cols = _rows(
        """SELECT a.attname FROM pg_index i
           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
           WHERE i.indrelid = %s::regclass AND i.indisprimary ORDER BY a.attnum""",
        [table],
    )
    return ", ".join(c for (c,) in cols) or "id"


def count(table: str, where: str = "TRUE") -> int:
    return _rows(f"SELECT count(*) FROM {table} WHERE {where}")[0][0]


def unfinished(table: str) -> int:
    terminal = sorted(s.value for s in TERMINAL)
    return _rows(f"SELECT count(*) FROM {table} WHERE status <> ALL(%s)", [terminal])[0][0]


def id_range(table: str) -> tuple[int | None, int | None]:
    return _rows(f"SELECT min(id), max(id) FROM {table}")[0]


def copy_out(table: str, cols: list[Column], where: str, order: str | None, out: BinaryIO) -> None:
    """The rows as PostgreSQL CSV into `out` (one statement, one snapshot)."""
    sql = f"SELECT {select_list(cols)} FROM {table} WHERE {where}"
    if order:
        sql += f" ORDER BY {order}"
    with (
        connection.cursor() as cur,
        cur.connection.cursor().copy(f"COPY ({sql}) TO STDOUT (FORMAT csv)") as copy,
    ):
        for chunk in copy:
            out.write(chunk)


def reattach(p: Partition) -> None:
    """Put a detached period back where it was (its bound check makes it a quick
    attach)."""
    with transaction.atomic():
        _attach(JOBS, p.jobs, p.start, p.end)
        if exists(p.events):
            _attach(EVENTS, p.events, period_start_utc(p.start), period_start_utc(p.end))


def _attach(parent: str, table: str, start: Any, end: Any) -> None:
    with connection.cursor() as cur:
        cur.execute(
            f"ALTER TABLE {parent} ATTACH PARTITION {table} "
            f"FOR VALUES FROM ('{start}') TO ('{end}')"
        )


def drop(p: Partition, side_rows: dict[str, int]) -> None:
    """In one transaction: the side rows of the period's jobs go (each table must still
    hold exactly the rows archived), then both tables. Run inside transaction.atomic."""
    with connection.cursor() as cur:
        for table, expected in side_rows.items():
            cur.execute(f"DELETE FROM {table} WHERE {SIDE_TABLES[table].format(jobs=p.jobs)}")
            if cur.rowcount != expected:
                raise SideRowsChanged(table, expected, cur.rowcount)
        cur.execute(f"DROP TABLE {p.jobs}")
        cur.execute(f"DROP TABLE IF EXISTS {p.events}")


class SideRowsChanged(Exception):
    def __init__(self, table: str, archived: int, found: int) -> None:
        super().__init__(
            f"{table}: {archived} rows archived but {found} found when dropping; "
            "nothing was dropped, run again to archive what is there now"
        )


# --- restore ---------------------------------------------------------------------------


def create_like(parent: str, table: str) -> None:
    """An empty table shaped like `parent` (columns, defaults, checks) with a primary key
    on id, outside the partitioned table: rows are loaded with no trigger firing."""
    with connection.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {table}")
        cur.execute(
            f"CREATE TABLE {table} (LIKE {parent} INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
            "INCLUDING STORAGE)"
        )


def copy_in(
    table: str, chunks: Iterable[tuple[list[Column], bytes]], on_conflict: bool = False
) -> int:
    """Rows of an archive file (files.csv_chunks) into `table`: COPY into a temporary
    table of the CSV's types, then one INSERT … SELECT turning microseconds back into
    timestamps and text into jsonb. With `on_conflict`, rows whose key is already there
    are skipped (an edge archived with both of its jobs' periods). Inside a transaction."""
    staging, cols, names = f"_load_{table}", [], ""
    with connection.cursor() as cur:
        for cols, data in chunks:
            if not names:
                names = ", ".join(f'"{c.name}"' for c in cols)
                cur.execute(f"DROP TABLE IF EXISTS {staging}")
                cur.execute(
                    f"CREATE TEMP TABLE {staging} ("
                    + ", ".join(f'"{c.name}" {_staging_type(c)}' for c in cols)
                    + ") ON COMMIT DROP"
                )
            with cur.connection.cursor().copy(f"COPY {staging} FROM STDIN (FORMAT csv)") as copy:
                copy.write(data)
        if not names:
            return 0
        conflict = f" ON CONFLICT ({primary_key(table)}) DO NOTHING" if on_conflict else ""
        cur.execute(
            f"INSERT INTO {table} ({names}) SELECT {', '.join(map(_from_staging, cols))} "
            f"FROM {staging}{conflict}"
        )
        count = cur.rowcount
        cur.execute(f"DROP TABLE {staging}")
        return count


def _staging_type(c: Column) -> str:
    if c.base_type == "timestamp with time zone":
        return "bigint"
    if c.base_type in ("jsonb", "json", "uuid"):
        return "text"
    return c.pg_type


def _from_staging(c: Column) -> str:
    name = f'"{c.name}"'
    if c.base_type == "timestamp with time zone":
        return (
            f"CASE WHEN {name} = {INFINITY} THEN 'infinity'::timestamptz "
            f"WHEN {name} = {-INFINITY} THEN '-infinity'::timestamptz "
            f"ELSE 'epoch'::timestamptz + {name} * interval '1 microsecond' END"
        )
    if c.base_type in ("jsonb", "json", "uuid"):
        return f"{name}::{c.base_type}"
    return name


def bound_of(table: str) -> str | None:
    """`FOR VALUES FROM (…) TO (…)` of an attached partition, as PostgreSQL prints it."""
    rows = _rows(
        "SELECT pg_get_expr(relpartbound, oid) FROM pg_class WHERE oid = to_regclass(%s)",
        [table],
    )
    return rows[0][0] if rows else None


def attach_restored(parent: str, loading: str, table: str, bound: str) -> None:
    """Name the loaded table for its period, give it its primary key and attach it with
    the bound it had (ATTACH scans it once to check the bound)."""
    if not re.fullmatch(r"FOR VALUES FROM \([^;]*\) TO \([^;]*\)", bound):
        raise ValueError(f"not a partition bound: {bound!r}")
    with connection.cursor() as cur:
        cur.execute(f"ALTER TABLE {loading} RENAME TO {table}")
        cur.execute(f"ALTER TABLE {table} ADD PRIMARY KEY (id)")
        cur.execute(f"ALTER TABLE {parent} ATTACH PARTITION {table} {bound}")
