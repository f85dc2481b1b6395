"""Sequences (issue 46.4): jobs with one `sequence_key` run strictly one at a time, in
submission order, across every worker; a job that fails (budget spent, or a permanent
error) halts the sequence until staff resume it (the failed job runs again, then the
rest in order) or skip it (it stays failed, the next job runs).

The ordering and the halt are the database's (jobs.flow.triggers): a job waiting its
turn is queued with run_at BLOCKED_RUN_AT, so no claim of any kind takes it, and the
end of the job before it makes it due in the same transaction. This module is the
staff's side (resume, skip), the reads of a sequence's page, and the push that wakes a
worker for a job a sequence made due.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, InterfaceError, connection, transaction

from jobs import services
from jobs.lifecycle import Status, WaitReason, hot_sql
from jobs.models import Job
from jobs.models import Sequence as SequenceRow

log = logging.getLogger(__name__)

# Waiting jobs a sequence's page lists (the count is exact).
PAGE = 50


class SequenceRefused(Exception):
    """A resume or skip that does not apply: `reason` is not_found or not_halted."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def owner_of(client_id: int | None) -> int:
    """The owner column: a client's id, 0 for the project's own jobs."""
    return client_id if client_id is not None else 0


def _locked(client_id: int | None, key: str) -> SequenceRow:
    row = SequenceRow.objects.select_for_update().filter(owner=owner_of(client_id), key=key).first()
    if row is None:
        raise SequenceRefused("not_found", f"no sequence {key!r}")
    if row.halted_job_id is None:
        raise SequenceRefused("not_halted", f"sequence {key!r} is not halted")
    return row


def resume(client_id: int | None, key: str, actor: str) -> int:
    """Run the job that halted the sequence again (a staff retry: budget reset); the
    jobs after it follow in order once it ends. Returns its id."""
    with transaction.atomic():
        row = _locked(client_id, key)
        job_id = row.halted_job_id
        # The retry's revive trigger sees the halted job and resumes the sequence.
        if not services.staff_retry([job_id], actor):
            raise SequenceRefused("not_halted", f"job {job_id} of {key!r} cannot be retried")
    log.info("sequence resumed", extra={"job_id": job_id, "sequence_key": key, "actor": actor})
    return job_id


_UNHALT_SQL = f"""
UPDATE jobs_job SET wait_reason = '{WaitReason.SEQUENCE}'
WHERE id = ANY(ARRAY(SELECT job_id FROM jobs_sequencewait WHERE sequence_id = %(seq)s))
  AND status = '{Status.QUEUED}' AND wait_reason = '{WaitReason.SEQUENCE_HALTED}'
  AND {hot_sql()}"""
_WAKE_SQL = """
WITH s AS (
  UPDATE jobs_sequence SET halted_job_id = NULL, halted_at = NULL, updated_at = now()
  WHERE id = %(seq)s RETURNING id
)
SELECT jobs_sequence_wake(id) FROM s"""


def skip(client_id: int | None, key: str, actor: str) -> int | None:
    """Leave the failed job failed and run the next job of the sequence. Returns the id
    of the job now due, or None when none was waiting."""
    with transaction.atomic():
        row = _locked(client_id, key)
        with connection.cursor() as cur:
            cur.execute(_UNHALT_SQL, {"seq": row.pk})
            cur.execute(_WAKE_SQL, {"seq": row.pk})
            woken = cur.fetchone()[0]
        if woken is not None:
            queue = Job.objects.filter(pk=woken).values_list("queue", flat=True).first()
            services.signal_after_commit([(woken, queue)], park_on_failure=False)
    log.info(
        "sequence halt skipped",
        extra={"job_id": row.halted_job_id, "sequence_key": key, "actor": actor, "next": woken},
    )
    return woken


@dataclass(frozen=True)
class Detail:
    key: str
    owner: int
    state: str  # idle, running, halted
    active_job: Job | None
    halted_job: Job | None
    halted_at: Any
    waiting: int
    next_jobs: list[Job]
    updated_at: Any

    def as_dict(self) -> dict[str, Any]:
        def brief(job: Job | None) -> dict[str, Any] | None:
            if job is None:
                return None
            return {"id": job.pk, "task": job.task, "status": job.status, "error": job.error}

        return {
            "key": self.key,
            "state": self.state,
            "active_job": brief(self.active_job),
            "halted_job": brief(self.halted_job),
            "halted_at": self.halted_at,
            "waiting": self.waiting,
            "next_jobs": [brief(j) for j in self.next_jobs],
            "updated_at": self.updated_at,
        }


def _live(job_id: int | None) -> Job | None:
    if job_id is None:
        return None
    return Job.objects.filter(pk=job_id).first()


def detail(client_id: int | None, key: str, *, owner: int | None = None) -> Detail | None:
    """A sequence's page: its state, the job whose turn it is, the job that halted it
    and the next PAGE waiting jobs in order. `owner` reads any client's (staff)."""
    row = SequenceRow.objects.filter(
        owner=owner if owner is not None else owner_of(client_id), key=key
    ).first()
    if row is None:
        return None
    waits = list(row.waits.order_by("position").values_list("job_id", flat=True)[:PAGE])
    by_id = Job.objects.in_bulk(waits)
    next_jobs = [
        by_id[i]
        for i in waits
        if i in by_id and by_id[i].status == Status.QUEUED and by_id[i].wait_reason
    ]
    waiting = row.waits.count()
    active = _live(row.active_job_id)
    if active is not None and active.status not in (Status.QUEUED, Status.PROCESSING):
        active = None
    halted = _live(row.halted_job_id)
    state = "halted" if halted is not None else "running" if active is not None else "idle"
    return Detail(
        row.key, row.owner, state, active, halted, row.halted_at, waiting, next_jobs,
        row.updated_at,
    )  # fmt: skip


def halted(limit: int = 100) -> list[SequenceRow]:
    """Halted sequences, oldest halt first (the admin, `queue list`)."""
    rows = SequenceRow.objects.filter(halted_job_id__isnull=False).order_by("halted_at")
    return list(rows[:limit])


def counts() -> dict[str, int]:
    """How many sequences are running and halted (`queue list`, the admin)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FILTER (WHERE active_job_id IS NOT NULL), "
            "count(*) FILTER (WHERE halted_job_id IS NOT NULL) FROM jobs_sequence"
        )
        running, halted_n = cur.fetchone()
    return {"running": running, "halted": halted_n}


# --- the push for what a sequence or batch made due --------------------------------

_DUE_AFTER_ENDS_SQL = f"""
SELECT j.id, j.queue FROM jobs_job e
JOIN jobs_sequence s ON s.owner = COALESCE(e.client_id, 0) AND s.key = e.sequence_key
JOIN jobs_job j ON j.id = s.active_job_id AND {hot_sql("j")}
WHERE e.id = ANY(%(ids)s::bigint[]) AND e.sequence_key IS NOT NULL AND {hot_sql("e")}
  AND j.status = '{Status.QUEUED}' AND j.run_at <= now()
UNION
SELECT j.id, j.queue FROM jobs_job e
JOIN jobs_batch b ON b.id = e.batch_id AND b.finished_at IS NOT NULL
JOIN jobs_job j ON j.id = ANY(b.callback_job_ids) AND {hot_sql("j")}
WHERE e.id = ANY(%(ids)s::bigint[]) AND e.batch_id IS NOT NULL AND {hot_sql("e")}
  AND j.status = '{Status.QUEUED}'"""


class _FlowsLive:
    """Whether any sequence or batch is live, read at most once a second: a process
    with neither pays no query per write-back."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self._at = float("-inf")
        self._any = False
        self._lock = threading.Lock()

    def __call__(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self.every:
                with connection.cursor() as cur:
                    cur.execute(
                        "SELECT EXISTS (SELECT 1 FROM jobs_sequence WHERE active_job_id IS NOT "
                        "NULL) OR EXISTS (SELECT 1 FROM jobs_batch WHERE finished_at IS NULL "
                        "OR finished_at > now() - interval '10 seconds')"
                    )
                    self._any = cur.fetchone()[0]
                self._at = now
            return self._any


flows_live = _FlowsLive()


def after_ends(job_ids: Seq[int]) -> None:
    """After a write-back ended `job_ids`: push the sequence jobs and batch callbacks
    those ends made due, now rather than at the next poll. A hint: a failure only
    delays them to the poll."""
    if not job_ids:
        return
    try:
        if not flows_live():
            return
        with connection.cursor() as cur:
            cur.execute(_DUE_AFTER_ENDS_SQL, {"ids": list(job_ids)})
            rows = cur.fetchall()
        services.signal_after_commit(rows, park_on_failure=False)
    except (DatabaseError, InterfaceError) as exc:
        log.warning("could not signal sequence or batch jobs (polling finds them): %s", exc)


__all__ = ["SequenceRefused", "after_ends", "detail", "resume", "skip"]
