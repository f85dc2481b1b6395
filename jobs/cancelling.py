"""Cancel a job from Python, as `POST /api/v1/jobs/{id}/cancel/` does.

    from jobs.cancelling import cancel
    cancel(job)          # a Job, a job id, or a Django Tasks result
    result.cancel()      # a result of jobs.backends.JobServiceBackend

queued or enqueue_failed → failed "cancelled" at once; processing → a cancel request
the worker hands the handler at its next heartbeat (a handler that stops ends failed
"cancelled", one that finishes anyway ends done with `cancel_too_late`); done or failed
→ `NotCancellable`, nothing written. One statement (`services.request_cancel`), in the
caller's transaction like `submit`, so it commits or rolls back with the caller's work.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from jobs import lifecycle, selectors, services
from jobs.exceptions import NotCancellable
from jobs.models import Client, Job

__all__ = ["CancelOutcome", "NotCancellable", "cancel"]

APP_ACTOR = "app"  # the application's own code, the actor `submit` records too


class CancelOutcome(StrEnum):
    CANCELLED = "cancelled"  # the job had not started: it is failed now (API: 200)
    REQUESTED = "requested"  # it is running: the worker stops it (API: 202)


def job_id_of(job: Any) -> int:
    """The id of a Job, a TaskResult (its `id` is the job id as text) or an id."""
    value = job.pk if isinstance(job, Job) else getattr(job, "id", job)
    if isinstance(value, bool) or not str(value).isdigit():
        raise TypeError(f"not a job, a task result or a job id: {job!r}")
    return int(value)


def cancel(job: Any, *, actor: str | None = None, client: Client | None = None) -> CancelOutcome:
    """Cancel `job` (a Job, a job id, or a TaskResult) whatever stage it is at.

    `actor` is who the history names: by default "app", or `client:<name>` with
    `client`, as `submit` records; with `client`, only that client's job may be
    cancelled, as over the API. Raises `Job.DoesNotExist`
    when there is no such job (of that client) and `NotCancellable` when it has
    finished (its `status` says how).
    """
    job_id = job_id_of(job)
    client_id = client.pk if client is not None else None
    by = actor or (lifecycle.actor(lifecycle.Role.CLIENT, client.name) if client else APP_ACTOR)
    outcome = services.request_cancel([job_id], by, client_id=client_id)
    if job_id in outcome:
        return CancelOutcome(outcome[job_id])
    status = selectors.job_status(job_id, client_id)
    if status is None:
        raise Job.DoesNotExist(f"no job {job_id}")
    raise NotCancellable(job_id, status)
