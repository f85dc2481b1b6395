"""Reading the archive back: which periods it holds, one job and its history from the
Parquet files, and a whole period restored into its partitions (`manage.py archive`).
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg.errors
from django.db import IntegrityError, connection, transaction
from django.utils import timezone
from rest_framework.fields import DateTimeField

from jobs import selectors
from jobs.archive import files, tables
from jobs.archive.files import ArchiveError
from jobs.lifecycle import Status, actor_role
from jobs.models import ArchivedPeriod, Job

# The API's fields of a job and of a history entry (jobs.api.serializers), in order.
JOB_FIELDS = (
    "id", "task", "queue", "priority", "status", "payload", "result", "error",
    "retry_count", "max_retries", "timeout", "lease_version", "idempotency_key", "run_at",
    "created_at", "updated_at", "finished_at", "progress", "cancel_requested_at",
    "cancel_too_late", "unique_key", "concurrency_key", "sequence_key", "batch", "schedule",
    "fire_time", "wait_reason", "chain_id", "run_number", "previous_run_ids", "next_run_id",
    "history",
)  # fmt: skip
STEPS = "jobs_jobstep"
# A durable run's history as the API counts it (selectors.JOB_HISTORY_SQL), from the
# archived step rows: stored again in a scratch table, so each result is sized as
# PostgreSQL stores it (a short header, compression), as the live row was.
_HISTORY_SQL = (
    "CREATE TEMP TABLE _shown_steps ON COMMIT DROP AS SELECT n AS name, r::jsonb AS result "
    "FROM unnest(%s::text[], %s::text[]) AS u(n, r)",
    "SELECT count(*) FILTER (WHERE left(name, 1) <> '~'), "
    "count(*) FILTER (WHERE left(name, 1) = '~'), coalesce(sum(pg_column_size(result)), 0) "
    "FROM _shown_steps",
)
EVENT_FIELDS = (
    "id", "kind", "at", "role", "from_status", "to_status", "lease_version", "retry_count",
    "error", "error_class", "error_traceback",
)  # fmt: skip
_TIME = DateTimeField()


class RestoreRefused(Exception):
    """The period cannot be restored as asked; nothing changed."""


@dataclass(frozen=True)
class Listed:
    period: datetime.date
    state: str  # archived, restored, detached (not dropped), detach pending
    jobs: int | None
    events: int | None
    files: int | None
    bytes: int | None
    archived_at: datetime.datetime | None
    location: str


def listing() -> list[Listed]:
    """Archived periods, and periods a retention run left detached but not dropped."""
    out = [
        Listed(
            a.period,
            "restored" if a.restored_at else "archived",
            a.jobs,
            a.events,
            len(a.files),
            a.bytes,
            a.archived_at,
            a.location,
        )
        for a in ArchivedPeriod.objects.order_by("period")
    ]
    for p in tables.partitions():
        if not p.attached:
            state = "detach pending" if p.detach_pending else "detached, not dropped"
            out.append(Listed(p.period, state, None, None, None, None, None, p.jobs))
    return sorted(out, key=lambda x: (x.period, x.state))


def archived_period_of(job_id: int) -> ArchivedPeriod | None:
    """The archived (not restored) period whose id range holds `job_id`; ranges of
    neighbouring periods may overlap, so the newest holding it is asked first."""
    return (
        ArchivedPeriod.objects.filter(
            min_job_id__lte=job_id, max_job_id__gte=job_id, restored_at__isnull=True
        )
        .order_by("-period")
        .first()
    )


def show(job_id: int) -> dict[str, Any] | None:
    """The archived job and its whole history, shaped like the API's job and history
    entries (plus the period and the client id), or None if no archive holds it."""
    candidates = ArchivedPeriod.objects.filter(
        min_job_id__lte=job_id, max_job_id__gte=job_id, restored_at__isnull=True
    ).order_by("-period")
    for a in candidates:
        directory = Path(a.location)
        rows = files.read_rows(directory / a.files[tables.JOBS]["file"], "id", job_id)
        if not rows:
            continue
        history = []
        for name in (tables.EVENTS, tables.LEGACY):
            if name in a.files:
                path = directory / a.files[name]["file"]
                history += files.read_rows(path, "job_id", job_id)
        history.sort(key=lambda e: e["id"])
        steps = []
        if STEPS in a.files:
            steps = files.read_rows(directory / a.files[STEPS]["file"], "job_id", job_id)
        return {
            "period": f"{a.period:%Y-%m-%d}",
            "archived_at": _TIME.to_representation(a.archived_at),
            "client": rows[0]["client_id"],
            "job": job_json(rows[0], steps),
            "history": [event_json(e) for e in history],
        }
    return None


def _time(value: Any) -> Any:
    if isinstance(value, datetime.datetime):
        return _TIME.to_representation(value)
    return value


def job_json(row: dict[str, Any], steps: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """An archived job row (and its durable step rows) as GET /jobs/<id>/ shows it."""
    known = {f.attname for f in Job._meta.concrete_fields}
    job = Job(**{k: v for k, v in row.items() if k in known})
    runs = row.get("previous_run_ids")  # an array's text in the file (files.Column)
    derived = {
        "progress": selectors.progress_of(job),
        "cancel_too_late": job.status == Status.DONE and job.cancel_requested_at is not None,
        "schedule": row.get("schedule_id"),
        "batch": row.get("batch_id"),
        "wait_reason": selectors.wait_reason(job),
        "run_number": row.get("run_number") or 1,
        "previous_run_ids": [int(i) for i in runs.strip("{}").split(",") if i]
        if isinstance(runs, str)
        else runs,
        "history": _history(steps),
    }
    return {f: derived[f] if f in derived else _time(row.get(f)) for f in JOB_FIELDS}


def _history(steps: list[dict[str, Any]]) -> dict[str, int]:
    names = [s["name"] for s in steps]
    results = [None if s.get("result") is None else json.dumps(s["result"]) for s in steps]
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(_HISTORY_SQL[0], [names, results])
        cur.execute(_HISTORY_SQL[1])
        n, waits, size = cur.fetchone()
    return {"steps": int(n), "waits": int(waits), "bytes": int(size)}


def event_json(row: dict[str, Any]) -> dict[str, Any]:
    derived = {"role": actor_role(row.get("actor") or "")}
    return {f: derived[f] if f in derived else _time(row.get(f)) for f in EVENT_FIELDS}


# --- restore ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Restored:
    period: datetime.date
    jobs: int
    events: int
    side_rows: dict[str, int]


def restore(period: datetime.date) -> Restored:
    """The period's partitions re-created from its files, verified and attached again,
    with the side rows of its jobs, in one transaction: a crash leaves nothing half
    restored. Refused while the period's tables exist."""
    try:
        archived = ArchivedPeriod.objects.get(period=period)
    except ArchivedPeriod.DoesNotExist:
        raise RestoreRefused(f"period {period:%Y-%m-%d} is not in the archive") from None
    jobs_table, events_table = tables.job_table(period), tables.event_table(period)
    for table in (jobs_table, events_table):
        if tables.exists(table):
            raise RestoreRefused(
                f"{table} exists: period {period:%Y-%m-%d} is attached (or detached and "
                "not dropped yet: run prunejobs to finish archiving it)"
            )
    directory = Path(archived.location)
    manifest = files.read_manifest(directory)
    if manifest is None:
        raise RestoreRefused(f"{directory}: no manifest")
    for entry in manifest["tables"].values():
        files.verify(directory, entry)
    counts: dict[str, int] = {}
    side: dict[str, int] = {}
    try:
        with transaction.atomic():
            for parent, table in ((tables.JOBS, jobs_table), (tables.EVENTS, events_table)):
                entry = manifest["tables"].get(parent)
                if entry is None:
                    continue
                loading = f"{table}_restore"
                tables.create_like(parent, loading)
                counts[parent] = _load(directory / entry["file"], loading)
                if counts[parent] != entry["rows"]:
                    raise ArchiveError(
                        f"{loading}: {counts[parent]} rows loaded, {entry['rows']} archived"
                    )
                tables.attach_restored(parent, loading, table, manifest["bounds"][parent])
                if tables.count(table) != entry["rows"]:
                    raise ArchiveError(f"{table}: count after attach is not {entry['rows']}")
            for name, entry in manifest["tables"].items():
                if name in tables.SIDE_TABLES:
                    side[name] = _load(directory / entry["file"], name, on_conflict=True)
            ArchivedPeriod.objects.filter(period=period).update(restored_at=timezone.now())
    except IntegrityError as e:
        if not isinstance(e.__cause__, psycopg.errors.ForeignKeyViolation):
            raise
        # A row the archived jobs point to is gone since: a client (its jobs no longer
        # protected it once archived), a workflow, a webhook.
        raise RestoreRefused(
            f"period {period:%Y-%m-%d}: {e.__cause__.diag.message_detail} Re-create it "
            "first; nothing was restored"
        ) from e
    return Restored(period, counts.get(tables.JOBS, 0), counts.get(tables.EVENTS, 0), side)


def _load(path: Path, table: str, on_conflict: bool = False) -> int:
    return tables.copy_in(table, files.csv_chunks(path), on_conflict=on_conflict)
