"""Retention: finished jobs (and their history) older than a cutoff leave the database.

Whole periods go by partition (jobs.archive.retention): detached, archived to Parquet in
JOBS_ARCHIVE_DIR, verified, dropped. Expired rows still in jobs_job_hot (the mover is
behind) are first moved to their periods, so they are archived with them (D213); only
without an archive directory are they deleted row-wise (D170). Both go in bounded
batches, each its own short statement, so it can run from cron beside live workers:
locked rows are skipped, never waited for, and no batch holds more than `--batch` row
locks.
"""

from __future__ import annotations

import re
import time
from functools import partial
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection, transaction

from jobs import extras, partitions, services
from jobs.archive import retention
from jobs.archive.tables import count as count_rows
from jobs.conf import settings
from jobs.lifecycle import STATUSES, TERMINAL

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$", re.IGNORECASE)
MAX_BATCH = 100_000


def parse_duration(text: str) -> int:
    """'7d', '12h', '30m', '45s', '2w' → seconds. Anything else is a clear error."""
    m = _DURATION.match(text or "")
    if not m:
        raise CommandError(
            f"--older-than {text!r} is not a duration: use a whole number and a unit "
            "s, m, h, d or w (for example 7d, 12h, 30m)"
        )
    seconds = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if seconds <= 0:
        raise CommandError(f"--older-than {text!r} must be longer than zero")
    return seconds


def parse_statuses(text: str) -> list[str]:
    """'done,failed' → the statuses, each checked to be terminal."""
    statuses = [s.strip() for s in (text or "").split(",") if s.strip()]
    if not statuses:
        raise CommandError("--status needs at least one status (done, failed)")
    terminal = sorted(s.value for s in TERMINAL)
    for s in statuses:
        if s not in STATUSES:
            raise CommandError(f"--status {s!r} is not a job status; terminal ones: {terminal}")
        if s not in TERMINAL:
            raise CommandError(
                f"--status {s!r} is not terminal: only finished jobs ({', '.join(terminal)}) "
                "can be pruned"
            )
    return sorted(set(statuses))


class Command(BaseCommand):
    help = (
        "Archive and drop the periods (partitions) that ended before now() - OLDER_THAN "
        "(database clock) once all their jobs finished before it. Expired jobs still in "
        "the hot partition are moved to their periods first (archived with them); without "
        "an archive directory they are deleted with their history instead, in bounded "
        "batches. Queued and running jobs are never touched."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add = parser.add_argument
        add("--older-than", required=True, help="Age of finished_at, e.g. 7d, 12h, 30m.")
        add("--status", default="done,failed", help="Terminal statuses to prune [%(default)s].")
        add("--batch", type=int, default=10_000, help="Jobs deleted per transaction [10000].")
        add(
            "--pause",
            type=float,
            default=0.0,
            help="Seconds to sleep between batches, to spare replicas and autovacuum [0].",
        )
        add("--dry-run", action="store_true", help="Count what would go; delete nothing.")
        add(
            "--archive-dir",
            default=None,
            help="Where expired periods are archived [JOBS_ARCHIVE_DIR]; without one they "
            "are kept.",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        age = parse_duration(opts["older_than"])
        statuses = parse_statuses(opts["status"])
        batch = opts["batch"]
        if not 1 <= batch <= MAX_BATCH:
            raise CommandError(f"--batch must be between 1 and {MAX_BATCH}, not {batch}")
        if opts["pause"] < 0:
            raise CommandError("--pause must not be negative")

        cutoff = self._scalar("SELECT now() - %s * interval '1 second'", [age])
        self.stdout.write(
            f"prunejobs: {', '.join(statuses)} jobs finished before {cutoff.isoformat()} "
            f"(database clock)"
        )
        archive_dir = opts["archive_dir"] or settings.JOBS_ARCHIVE_DIR
        every_terminal = set(statuses) == {s.value for s in TERMINAL}
        if opts["dry_run"]:
            if every_terminal:
                self._periods(retention.archive_expired(age, archive_dir, dry_run=True), True)
            # With an archive directory every expired finished job moves, whatever --status.
            terminal = sorted(s.value for s in TERMINAL)
            self._dry_run(age, terminal if archive_dir else statuses, bool(archive_dir))
            return
        if archive_dir:
            # Before the periods: a period held back only by the mover's lag goes now.
            self._move_expired(age, batch, opts["pause"])
        if every_terminal:
            try:
                report = retention.archive_expired(age, archive_dir, progress=self.stdout.write)
            except (retention.ArchiveStopped, extras.MissingExtra) as e:
                raise CommandError(str(e)) from e
            self._periods(report, False)
        else:
            self.stdout.write("periods: kept (--status names only some terminal statuses)")
        if archive_dir:
            self._kept_hot(age)
        else:
            self._delete_hot(age, statuses, batch, opts["pause"])

    def _move_expired(self, age: int, batch: int, pause: float) -> None:
        """The mover's own batches for the jobs finished before the cutoff: each goes to
        its period and leaves with it, never without a copy (D213)."""
        total = 0
        while True:
            n = services.moved_retry(partial(partitions.move_batch, age, batch))
            total += n
            if n < batch:
                break
            if pause:
                time.sleep(pause)
        self.stdout.write(f"moved {total} expired jobs from jobs_job_hot to their periods")

    def _kept_hot(self, age: int) -> None:
        left = self._scalar(
            "SELECT count(*) FROM jobs_job_hot WHERE status = ANY(%s) "
            "AND finished_at < now() - %s * interval '1 second'",
            [sorted(s.value for s in TERMINAL), age],
        )
        if left:
            self.stdout.write(
                self.style.WARNING(
                    f"{left} expired jobs stay in jobs_job_hot (locked, or their period is "
                    "detached or archived): they are moved and archived by a later run"
                )
            )

    def _delete_hot(self, age: int, statuses: list[str], batch: int, pause: float) -> None:
        """No archive directory: the expired rows of jobs_job_hot go row by row (D170)."""
        total = batches = 0
        started = time.monotonic()
        while True:
            with transaction.atomic():
                n = services.prune_finished(age, statuses, batch)
            batches += 1
            total += n
            self.stdout.write(f"batch {batches}: {n} jobs deleted")
            # A short batch means nothing unlocked is left; rows skipped because
            # another transaction held them go in the next run.
            if n < batch:
                break
            if pause:
                time.sleep(pause)
        self.stdout.write(
            self.style.SUCCESS(
                f"pruned {total} jobs and their history in {batches} batches "
                f"({time.monotonic() - started:.1f} s)"
            )
        )

    def _periods(self, report: retention.Report, dry_run: bool) -> None:
        for period, why in report.held:
            self.stdout.write(f"period {period:%Y-%m-%d} held back: {why}")
        for p in report.pending:
            jobs = count_rows(p.jobs)
            what = f"period {p.period:%Y-%m-%d} ({p.jobs}, {jobs} jobs)"
            if dry_run:
                self.stdout.write(f"dry run: would archive and drop {what}")
            else:
                self.stdout.write(
                    self.style.WARNING(
                        f"{what} expired but kept: set JOBS_ARCHIVE_DIR (or --archive-dir) "
                        "to archive it"
                    )
                )
        for p in report.archived:
            self.stdout.write(p.line())
        if report.archived:
            self.stdout.write(
                self.style.SUCCESS(
                    f"archived {len(report.archived)} periods ({report.jobs} jobs, "
                    f"{report.events} history rows) to {report.archive_dir} and dropped them "
                    f"({report.seconds:.1f} s)"
                )
            )
        elif not dry_run:
            self.stdout.write("periods: none expired")

    def _dry_run(self, age: int, statuses: list[str], archiving: bool) -> None:
        with connection.cursor() as cur:
            cur.execute(
                """SELECT status, count(*) FROM jobs_job_hot
                   WHERE status = ANY(%s) AND finished_at < now() - %s * interval '1 second'
                   GROUP BY status ORDER BY status""",
                [statuses, age],
            )
            counts = dict(cur.fetchall())
            cur.execute(
                """SELECT count(*) FROM jobs_jobevent e JOIN jobs_job_hot j ON j.id = e.job_id
                   WHERE j.status = ANY(%s) AND j.finished_at < now() - %s * interval '1 second'""",
                [statuses, age],
            )
            events = cur.fetchone()[0]
        by_status = ", ".join(f"{s}: {counts.get(s, 0)}" for s in statuses)
        if archiving:
            self.stdout.write(
                f"dry run: would move {sum(counts.values())} expired jobs ({by_status}) from "
                "jobs_job_hot to their periods, to be archived with them; nothing deleted "
                "row by row"
            )
            return
        self.stdout.write(
            f"dry run: would delete {sum(counts.values())} jobs ({by_status}) "
            f"and {events} history rows; nothing deleted"
        )

    @staticmethod
    def _scalar(sql: str, params: list[Any]) -> Any:
        with connection.cursor() as cur:
            cur.execute(sql, params)
            return cur.fetchone()[0]
