"""The answer to `POST /api/v1/jobs/`, written by hand from the job the submission built.

SubmittedJobSerializer's document, field for field and in its order, without DRF's
per-field dispatch (4-5 % of a submission's CPU, issue 31, D150). The serializer stays
the schema and the answer of every other route; the tests compare the two for many
generated jobs. A project whose DRF settings change how dates or big integers are
written gets the serializer's answer.
"""

from __future__ import annotations

from datetime import datetime, tzinfo
from typing import Any

from django.utils import timezone
from rest_framework.settings import ISO_8601, api_settings

from jobs import selectors
from jobs.api.serializers import SubmittedJobSerializer
from jobs.lifecycle import Status
from jobs.models import Job


def _when(value: datetime | None, tz: tzinfo) -> str | None:
    """DRF's DateTimeField for an aware datetime in ISO 8601: the current time zone, 'Z'
    for UTC."""
    if value is None:
        return None
    text = value.astimezone(tz).isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def _plain_settings() -> bool:
    return api_settings.DATETIME_FORMAT == ISO_8601 and not getattr(
        api_settings, "COERCE_BIG_INT_TO_STRING", False
    )


def submitted(job: Job) -> dict[str, Any]:
    """SubmittedJobSerializer(job).data, as a plain dict."""
    dates = (job.run_at, job.created_at, job.updated_at, job.finished_at)
    stamps = (job.cancel_requested_at, job.fire_time)
    if not _plain_settings() or any(d is not None and d.tzinfo is None for d in dates + stamps):
        return dict(SubmittedJobSerializer(job).data)
    tz = timezone.get_current_timezone()
    timeout = job.timeout
    if job.queue_paused is None or job.progress is not None:  # a row read from the table
        progress, wait_reason = selectors.progress_and_wait(job)
    else:  # the row its INSERT returned, with its queue's state: nothing more to read
        progress = None
        wait_reason = job.wait_reason or (  # as selectors.wait_reason
            selectors.QUEUE_PAUSED if job.status == Status.QUEUED and job.queue_paused else None
        )
    return {
        "id": job.id,
        "task": job.task,
        "queue": job.queue,
        "priority": job.priority,
        "status": job.status,
        "payload": job.payload,
        "result": job.result,
        "error": job.error,
        "retry_count": job.retry_count,
        "max_retries": job.max_retries,
        "timeout": None if timeout is None else float(timeout),
        "lease_version": job.lease_version,
        "idempotency_key": job.idempotency_key,
        "run_at": _when(job.run_at, tz),
        "created_at": _when(job.created_at, tz),
        "updated_at": _when(job.updated_at, tz),
        "finished_at": _when(job.finished_at, tz),
        "progress": progress,
        "cancel_requested_at": _when(job.cancel_requested_at, tz),
        "cancel_too_late": job.status == Status.DONE and job.cancel_requested_at is not None,
        "unique_key": job.unique_key,
        "concurrency_key": job.concurrency_key,
        "sequence_key": job.sequence_key,
        "batch": job.batch_id,
        "schedule": job.schedule_id,
        "fire_time": _when(job.fire_time, tz),
        "wait_reason": wait_reason,
        "chain_id": job.chain_id,
        "run_number": job.run_number or 1,
        "previous_run_ids": job.previous_run_ids,
        "next_run_id": job.next_run_id,
        "duplicate": job.duplicate,
        "debounced": job.debounced,
        "skipped": job.skipped,
    }
