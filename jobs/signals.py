"""Signals to durable jobs from Django code: `signal_job(job_id, key, payload)`.

A signal is stored durably (jobs_jobsignal) and makes the job due now if it is
parked waiting for `key`; a signal that arrives before the wait is kept, and the
wait consumes it. The API's `POST /api/v1/jobs/<id>/signal/` calls the same thing.
"""

from __future__ import annotations

from typing import Any

from jobs import services, validation
from jobs.exceptions import InvalidSubmission
from jobs.services import SignalRefused

__all__ = ["MAX_KEY", "SignalRefused", "signal_job"]

MAX_KEY = 190  # the wait's checkpoint name adds "~signal:" to the key


def check_key(key: Any) -> str:
    """The key exactly as sent or a refusal: never trimmed, never a number made text
    (the job's wait names the key it waits for; a rewritten one would never match)."""
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY:
        raise InvalidSubmission(
            f"key must be a string of 1-{MAX_KEY} characters", field="key", code="invalid_key"
        )
    if why := validation.why_unstorable(key):
        raise InvalidSubmission(f"key may not contain {why}", field="key", code="invalid_key")
    return key


def signal_job(
    job_id: int, key: str, payload: Any = None, *, actor: str = "app", client_id: int | None = None
) -> bool:
    """Deliver signal `key` with `payload` to a job. Returns True when it woke the job
    (parked waiting for that key), False when it is kept for a wait to come.

    Raises SignalRefused (reason "not_found", "finished", "not_waiting": parked waiting
    for another key, or "duplicate": one signal per key per job) and InvalidSubmission
    for a key or payload that cannot be stored.
    Runs in the caller's transaction when there is one: the wake-up counts from commit.
    """
    check_key(key)
    payload_json = (
        "null" if payload is None else validation.serialise_payload(payload).decode("utf-8")
    )
    return services.deliver_signal(job_id, key, payload_json, actor=actor, client_id=client_id)
