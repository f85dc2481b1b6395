"""Retention by partition: expired periods are detached, archived to Parquet, verified
and dropped (prunejobs; `archive_expired` for a benchmark or a script).

A period is expired when it ended before the cutoff (now() - retention, database
clock), no job created in it is still in jobs_job_hot, and every one of its jobs
finished before the cutoff. For each, in order:

1. detach: `DETACH PARTITION … CONCURRENTLY` of its jobs and its history (or
   `FINALIZE` of a detach a crash left pending): writers are never blocked;
2. check: every detached row is finished, else both tables go back and retention stops;
3. write: the jobs, their history and their side rows (legacy history, steps,
   signals, workflow nodes and edges, webhook deliveries) as Parquet files, then the
   manifest, each under a temporary name, fsynced and renamed;
4. verify: each file re-read against the manifest's sha256 and row count and against
   the table's count now;
5. drop: in one transaction the side rows are deleted, both tables dropped and the
   period recorded in jobs_archivedperiod.

Every step can be killed: the next run finds the period detached (or pending), writes
its files again from the detached tables and goes on. Nothing is dropped before its
files verified.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from jobs import extras
from jobs.archive import files, tables
from jobs.archive.files import ArchiveError
from jobs.models import ArchivedPeriod

log = logging.getLogger("jobs.archive")


class ArchiveStopped(Exception):
    """Retention stopped at a period; what was archived before it stays archived."""


class PeriodHeld(Exception):
    """Found after DETACH: a job of the period is hot again; the period went back."""

    def __init__(self, period: datetime.date, why: str) -> None:
        super().__init__(why)
        self.period, self.why = period, why


@dataclass
class PeriodReport:
    period: datetime.date
    jobs: int = 0
    events: int = 0
    side_rows: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    location: str = ""
    seconds: dict[str, float] = field(default_factory=dict)  # step → seconds

    def line(self) -> str:
        steps = ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())
        side = sum(self.side_rows.values())
        return (
            f"period {self.period:%Y-%m-%d}: {self.jobs} jobs, {self.events} history rows, "
            f"{side} side rows, {self.bytes / 1e6:.1f} MB → {self.location} ({steps})"
        )


@dataclass
class Report:
    cutoff: datetime.datetime
    archive_dir: str
    archived: list[PeriodReport] = field(default_factory=list)
    held: list[tuple[datetime.date, str]] = field(default_factory=list)
    # Expired (or left detached) but not archived: no archive directory, or a dry run.
    pending: list[tables.Partition] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def jobs(self) -> int:
        return sum(p.jobs for p in self.archived)

    @property
    def events(self) -> int:
        return sum(p.events for p in self.archived)


def cutoff_for(older_than_seconds: float) -> datetime.datetime:
    with connection.cursor() as cur:
        cur.execute("SELECT now() - %s * interval '1 second'", [older_than_seconds])
        return cur.fetchone()[0]


def expired(cutoff: datetime.datetime) -> tuple[list[tables.Partition], list[tuple]]:
    """Periods to archive (left detached by an earlier run first, then attached ones
    past the cutoff, oldest first) and those held back, with why."""
    todo, held = [], []
    for p in tables.partitions():
        if not p.attached:
            todo.append(p)  # detached or pending: an earlier run stopped midway
            continue
        if p.end is None or tables.period_start_utc(p.end) > cutoff:
            continue
        reason = tables.held_back(p, cutoff)
        if reason:
            held.append((p.period, reason))
        else:
            todo.append(p)
    todo.sort(key=lambda p: (p.attached, p.period))
    return todo, held


def archive_expired(
    older_than_seconds: float,
    archive_dir: str | Path | None,
    *,
    dry_run: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Archive and drop every expired period; the report says what went where and how
    long each step took. Without `archive_dir` (or with `dry_run`) nothing changes and
    the report lists what would go."""
    if older_than_seconds <= 0:
        raise ValueError("older_than_seconds must be positive")
    started = time.monotonic()
    cutoff = cutoff_for(older_than_seconds)
    report = Report(cutoff, str(archive_dir or ""))
    if dry_run or not archive_dir:
        report.pending, report.held = expired(cutoff)
        return report
    extras.require("archive")  # before any period is detached
    root = Path(archive_dir)
    with tables.archiving() as alone:
        if not alone:
            raise ArchiveStopped(
                "another prunejobs is archiving periods now (or a reaper is attaching a "
                "partition a detach left pending); nothing done"
            )
        todo, report.held = expired(cutoff)
        for p in todo:
            try:
                report.archived.append(archive_period(p, root, progress))
            except PeriodHeld as e:
                report.held.append((e.period, e.why))
    report.seconds = time.monotonic() - started
    return report


def archive_period(
    p: tables.Partition, root: Path, progress: Callable[[str], None] | None = None
) -> PeriodReport:
    out = PeriodReport(p.period)
    directory = root / f"{p.period:%Y%m%d}"
    out.location = str(directory)

    def step(name: str, fn: Callable[[], Any]) -> Any:
        t = time.monotonic()
        result = fn()
        out.seconds[name] = time.monotonic() - t
        if progress:
            progress(f"period {p.period:%Y-%m-%d}: {name} {out.seconds[name]:.2f} s")
        return result

    if p.start is None or p.end is None:
        raise ArchiveStopped(
            f"{p.jobs} is detached without the check of its bound that DETACH … "
            "CONCURRENTLY leaves: attach it again (or add the check) and run again"
        )
    earlier = ArchivedPeriod.objects.filter(period=p.period, restored_at__isnull=True).first()
    if earlier is not None:
        raise ArchiveStopped(
            f"period {p.period:%Y-%m-%d} was archived at {earlier.archived_at:%Y-%m-%d %H:%M} "
            f"to {earlier.location} and {p.jobs} exists again: its files are not "
            "overwritten; move them aside (and delete its jobs_archivedperiod row) to "
            "archive the table as it is now"
        )
    bounds = {tables.JOBS: tables.bound_of(p.jobs), tables.EVENTS: tables.bound_of(p.events)}
    step("detach", lambda: tables.detach(p))
    step("check", lambda: _check_finished(p))
    manifest = step("write", lambda: _write(p, directory, bounds))
    out.jobs = manifest["tables"][tables.JOBS]["rows"]
    out.events = manifest["tables"].get(tables.EVENTS, {}).get("rows", 0)
    side = {t: e["rows"] for t, e in manifest["tables"].items() if t in tables.SIDE_TABLES}
    out.side_rows = side
    out.bytes = sum(e["bytes"] for e in manifest["tables"].values())
    step("verify", lambda: _verify(p, directory, manifest))
    step("drop", lambda: _drop(p, directory, manifest, side))
    log.info(
        "period %s archived: %s jobs, %s history rows to %s",
        p.period,
        out.jobs,
        out.events,
        directory,
    )
    return out


def _check_finished(p: tables.Partition) -> None:
    bad = tables.unfinished(p.jobs)
    if not bad:
        hot = tables.still_hot(p)
        if hot:  # a staff retry brought one back between the first look and DETACH
            tables.reattach(p)
            raise PeriodHeld(p.period, f"{hot} jobs created in it are still in {tables.HOT}")
        return
    what = f"period {p.period:%Y-%m-%d}: {bad} jobs in {p.jobs} are not finished"
    try:
        tables.reattach(p)
    except DatabaseError as e:
        raise ArchiveStopped(
            f"{what}; nothing was archived, and attaching it again failed ({e}): it stays "
            "detached until its rows are fixed and it is attached by hand"
        ) from e
    raise ArchiveStopped(
        f"{what}; the period was attached again and nothing was archived (only finished "
        "jobs belong in a cold partition)"
    )


def _write(p: tables.Partition, directory: Path, bounds: dict[str, str | None]) -> dict:
    """Every file of the period, then its manifest (the manifest last: files it names
    are whole)."""
    sources: list[tuple[str, str, str]] = [(tables.JOBS, p.jobs, "TRUE")]
    if tables.exists(p.events):
        sources.append((tables.EVENTS, p.events, "TRUE"))
    for table, where in tables.SIDE_TABLES.items():
        if tables.exists(table):
            sources.append((table, table, where.format(jobs=p.jobs)))
    entries = {}
    for name, table, where in sources:
        cols = tables.columns(table)
        order = tables.ORDER.get(name) or tables.primary_key(table)
        entries[name] = files.write_table(
            directory,
            name,
            cols,
            name,
            lambda f, table=table, cols=cols, where=where, order=order: tables.copy_out(
                table, cols, where, order, f
            ),
        ).as_dict()
        entries[name]["where"] = where if name in tables.SIDE_TABLES else None
    low, high = tables.id_range(p.jobs)
    manifest = {
        "schema_version": files.SCHEMA_VERSION,
        "period": f"{p.period:%Y-%m-%d}",
        "starts_at": tables.period_start_utc(p.start).isoformat(),
        "ends_at": tables.period_start_utc(p.end).isoformat(),
        "bounds": {k: v or _bound_text(k, p) for k, v in bounds.items()},
        "tables": entries,
        "jobs": entries[tables.JOBS]["rows"],
        "min_job_id": low,
        "max_job_id": high,
        "archived_at": timezone.now().isoformat(),
    }
    files.write_manifest(directory, manifest)
    return manifest


def _bound_text(parent: str, p: tables.Partition) -> str:
    """The bound of a period detached by an earlier run (no longer in the catalog)."""
    if parent == tables.JOBS:
        return f"FOR VALUES FROM ('{p.start}') TO ('{p.end}')"
    lo, hi = tables.period_start_utc(p.start), tables.period_start_utc(p.end)
    return f"FOR VALUES FROM ('{lo}') TO ('{hi}')"


def _verify(p: tables.Partition, directory: Path, manifest: dict) -> None:
    for name, entry in manifest["tables"].items():
        if name == tables.JOBS:
            rows = tables.count(p.jobs)
        elif name == tables.EVENTS:
            rows = tables.count(p.events)
        else:
            rows = tables.count(name, entry["where"])
        try:
            files.verify(directory, entry, expected_rows=rows)
        except ArchiveError as e:
            raise ArchiveStopped(
                f"period {p.period:%Y-%m-%d} failed verification, nothing dropped "
                f"({p.jobs} stays detached; the next run writes its files again): {e}"
            ) from e


def _drop(p: tables.Partition, directory: Path, manifest: dict, side: dict[str, int]) -> None:
    try:
        with transaction.atomic():
            tables.drop(p, side)
            ArchivedPeriod.objects.update_or_create(
                period=p.period,
                defaults={
                    "starts_at": manifest["starts_at"],
                    "ends_at": manifest["ends_at"],
                    "jobs": manifest["jobs"],
                    "events": manifest["tables"].get(tables.EVENTS, {}).get("rows", 0),
                    "min_job_id": manifest["min_job_id"],
                    "max_job_id": manifest["max_job_id"],
                    "location": str(directory),
                    "files": manifest["tables"],
                    "bytes": sum(e["bytes"] for e in manifest["tables"].values()),
                    "archived_at": manifest["archived_at"],
                    "restored_at": None,
                },
            )
    except tables.SideRowsChanged as e:
        raise ArchiveStopped(f"period {p.period:%Y-%m-%d}: {e}") from e
