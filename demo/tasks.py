"""Example tasks: how an application adds its own (list this module in JOBS_TASK_MODULES).

They double as the workload of the fault suite and the end-to-end tests, so each is
registered with example=True: installed with the deployment, none is open to clients
(demo.crash kills its worker) unless JOBS_PUBLIC_TASKS names it (D196). Your own tasks
leave `example` out and are public.
"""

from __future__ import annotations

import os
import random
import signal
from typing import Any

from demo.models import Effect
from jobs.tasks import InvalidPayload, JobContext, PermanentError, RetryableError, task


def _seconds(payload: Any) -> float:
    value = payload.get("seconds", 0) if isinstance(payload, dict) else 0
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 600:
        raise InvalidPayload("seconds must be a number between 0 and 600")
    return float(value)


def _validate(payload: Any) -> None:
    if not isinstance(payload, dict):
        raise InvalidPayload("payload must be an object")
    _seconds(payload)


@task("demo.record", transactional=True, validate=_validate, example=True)
def record(payload: dict, ctx: JobContext) -> dict:
    """Write one Effect row, optionally after working for `seconds`.

    transactional=True: the row commits only with this worker's fenced result.
    """
    if not ctx.sleep(_seconds(payload)):
        raise RetryableError("interrupted")
    Effect.objects.create(
        job_id=ctx.job_id, lease_version=ctx.lease_version, worker_id=ctx.worker_id
    )
    return {"recorded_by": ctx.worker_id, "lease_version": ctx.lease_version}


@task("demo.flaky", validate=_validate, example=True)
def flaky(payload: dict, ctx: JobContext) -> dict:
    """Fail with probability `p` (retryable), else succeed."""
    p = float(payload.get("p", 0.5))
    if not ctx.sleep(_seconds(payload)):
        raise RetryableError("interrupted")
    if random.random() < p:
        raise RetryableError(f"flaky failure on attempt {ctx.attempt}")
    return {"attempt": ctx.attempt}


@task("demo.permanent", example=True)
def permanent(payload: Any, ctx: JobContext) -> None:
    """Always fail permanently: no retries."""
    raise PermanentError("demo.permanent always fails permanently")


@task("demo.crash", example=True)
def crash(payload: Any, ctx: JobContext) -> None:
    """Kill the worker process running it (SIGKILL): a crash on every attempt."""
    os.kill(os.getpid(), signal.SIGKILL)
