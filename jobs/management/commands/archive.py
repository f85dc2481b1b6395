"""`archive list | show <job id> | restore <period>`: the Parquet archive of expired
periods, read back (jobs.archive.restore)."""

from __future__ import annotations

import datetime
import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs import extras
from jobs.archive import restore
from jobs.archive.files import ArchiveError


def period_arg(text: str) -> datetime.date:
    """'2026-11-02' or '20261102' (as in the table's name jobs_job_p20261102)."""
    for fmt in ("%Y-%m-%d", "%Y%m%d"):
        try:
            return datetime.datetime.strptime(text, fmt).date()
        except ValueError:
            pass
    raise CommandError(f"period {text!r} is not a date: use YYYY-MM-DD (the day it starts)")


def job_id_arg(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise CommandError(f"job id {text!r} is not a positive whole number")
    return int(text)


class Command(BaseCommand):
    help = (
        "The archive of expired periods (prunejobs): list them, show an archived job with "
        "its history as JSON, or restore a period into its partitions."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        sub.add_parser("list", help="Archived periods, and periods detached but not dropped.")
        show = sub.add_parser("show", help="An archived job and its history, as JSON.")
        show.add_argument("job_id", help="The job's id.")
        back = sub.add_parser(
            "restore", help="Re-create a period's partitions from its files and attach them."
        )
        back.add_argument("period", help="The day the period starts, YYYY-MM-DD.")

    def handle(self, *args: Any, **opts: Any) -> None:
        action = opts["action"]
        try:
            if action == "list":
                self._list()
            elif action == "show":
                self._show(job_id_arg(opts["job_id"]))
            else:
                self._restore(period_arg(opts["period"]))
        except (ArchiveError, restore.RestoreRefused, extras.MissingExtra) as e:
            raise CommandError(str(e)) from e

    def _list(self) -> None:
        rows = restore.listing()
        if not rows:
            self.stdout.write("nothing archived, nothing detached")
            return
        self.stdout.write(
            f"{'period':<10}  {'state':<22} {'jobs':>10} {'history':>11} {'files':>5} "
            f"{'MB':>9}  {'archived at':<25} location"
        )
        for r in rows:
            cells = ["" if v is None else v for v in (r.jobs, r.events, r.files)]
            mb = "" if r.bytes is None else f"{r.bytes / 1e6:.1f}"
            at = "" if r.archived_at is None else r.archived_at.isoformat(timespec="seconds")
            self.stdout.write(
                f"{r.period:%Y-%m-%d}  {r.state:<22} {cells[0]:>10} {cells[1]:>11} "
                f"{cells[2]:>5} {mb:>9}  {at:<25} {r.location}"
            )

    def _show(self, job_id: int) -> None:
        found = restore.show(job_id)
        if found is None:
            raise CommandError(f"job {job_id} is in no archived period")
        self.stdout.write(json.dumps(found, indent=2, ensure_ascii=False))

    def _restore(self, period: datetime.date) -> None:
        done = restore.restore(period)
        side = ", ".join(f"{t}: {n}" for t, n in done.side_rows.items() if n) or "none"
        self.stdout.write(
            self.style.SUCCESS(
                f"period {period:%Y-%m-%d} restored: {done.jobs} jobs, {done.events} history "
                f"rows attached again; side rows: {side}"
            )
        )
