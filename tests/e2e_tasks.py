"""Tasks for end-to-end tests only (JOBS_TASK_MODULES=demo.tasks,tests.e2e_tasks):
handlers whose results or errors PostgreSQL cannot store as they are."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from django.db import connection

from jobs.tasks import InvalidPayload, JobContext, PermanentError, RetryableError, task


@task("e2e.unserializable")
def unserializable(payload: Any, ctx: JobContext) -> Any:
    """Returns a set: not JSON."""
    return {"ids": {1, 2, 3}}


@task("e2e.nan")
def nan(payload: Any, ctx: JobContext) -> Any:
    """Returns NaN: Python's json writes it, jsonb refuses it."""
    return {"ratio": float("nan")}


@task("e2e.nul_result")
def nul_result(payload: Any, ctx: JobContext) -> Any:
    """Returns a string with a NUL character, which jsonb cannot store."""
    return {"text": "a\x00b"}


@task("e2e.nul_error")
def nul_error(payload: Any, ctx: JobContext) -> Any:
    """Raises an error whose message holds a NUL character (text columns refuse it)."""
    raise ValueError("bad\x00byte")


@task("e2e.unserializable_tx", transactional=True)
def unserializable_tx(payload: Any, ctx: JobContext) -> Any:
    """Transactional, returns a set: its fenced completion cannot write it."""
    return {"ids": {1}}


LONE_SURROGATE = b"caf\xe9".decode("utf-8", "surrogateescape")


@task("e2e.surrogate_result")
def surrogate_result(payload: Any, ctx: JobContext) -> Any:
    """Returns a lone surrogate (bytes decoded with surrogateescape): not valid UTF-8."""
    return {"name": LONE_SURROGATE}


@task("e2e.surrogate_error")
def surrogate_error(payload: Any, ctx: JobContext) -> Any:
    """Raises an error whose message holds a lone surrogate."""
    raise ValueError(f"cannot decode {LONE_SURROGATE}")


@task("e2e.nul_invalid_payload")
def nul_invalid_payload(payload: Any, ctx: JobContext) -> Any:
    """Raises InvalidPayload with a NUL character (a permanent error)."""
    raise InvalidPayload("a\x00b")


@task("e2e.slow_tx", transactional=True)
def slow_tx(payload: Any, ctx: JobContext) -> Any:
    """Transactional: reads the database (its transaction begins), works `seconds`."""
    with connection.cursor() as cur:
        cur.execute("SELECT 1")
    time.sleep(float(payload["seconds"]))
    return {"slept": payload["seconds"]}


class CardDeclined(PermanentError):
    """A permanent failure, as a payment provider would report it."""


def _charge(amount: int) -> None:
    raise CardDeclined(f"card declined: insufficient funds for {amount}")


@task("e2e.card_declined")
def card_declined(payload: Any, ctx: JobContext) -> Any:
    """Fails permanently two frames down (the traceback must show where)."""
    _charge(payload.get("amount", 0))


@task("e2e.value_error")
def value_error(payload: Any, ctx: JobContext) -> Any:
    """Fails with a retryable error on every attempt."""
    raise ValueError(f"attempt {ctx.attempt} broke")


@task("e2e.progress")
def progress(payload: Any, ctx: JobContext) -> Any:
    """Reports progress `steps` times over `seconds`, its lease version in the message;
    stops early (and is cancelled) when told to."""
    steps, seconds = int(payload["steps"]), float(payload["seconds"])
    for i in range(1, steps + 1):
        if not ctx.sleep(seconds / steps):
            return {"stopped_at": i}
        ctx.progress(i, steps, f"lv{ctx.lease_version} step {i}")
    return {"steps": steps}


@task("e2e.ignore_cancel")
def ignore_cancel(payload: Any, ctx: JobContext) -> Any:
    """Sleeps without ever looking at ctx.stop: a cancel request comes too late for it."""
    time.sleep(float(payload["seconds"]))
    return {"ignored": True}


@task("e2e.tx_then_wait", transactional=True)
def tx_then_wait(payload: Any, ctx: JobContext) -> Any:
    """Transactional: writes an Effect row, then works until told to stop and returns."""
    from demo.models import Effect

    Effect.objects.create(job_id=ctx.job_id, lease_version=ctx.lease_version,
                          worker_id=ctx.worker_id)  # fmt: skip
    ctx.sleep(float(payload["seconds"]))
    return {"cancelled": ctx.cancelled}


@task("e2e.record_call")
def record_call(payload: Any, ctx: JobContext) -> Any:
    """Not transactional: records each call of its handler (an Effect row, through the
    ORM on the handler thread's own connection), then works `seconds`."""
    from demo.models import Effect

    Effect.objects.create(job_id=ctx.job_id, lease_version=ctx.lease_version,
                          worker_id=ctx.worker_id)  # fmt: skip
    time.sleep(float(payload.get("seconds", 0)))
    return {"recorded": ctx.lease_version}


@task("e2e.hold")
def hold(payload: Any, ctx: JobContext) -> Any:
    """Works until the file `gate` exists, on every attempt: a test that needs the job
    running opens the gate when it is done with it, however slow the machine."""
    gate = Path(payload["gate"])
    while not gate.exists():
        if not ctx.sleep(0.05):
            raise RetryableError("stopped before the gate opened")
    return {"held_by": ctx.worker_id}


@task("e2e.sequence_step")
def sequence_step(payload: Any, ctx: JobContext) -> Any:
    """Works `seconds`, then fails permanently while the file `gate` exists: a sequence's
    halt that a test lifts by removing the file before it resumes."""
    time.sleep(float(payload.get("seconds", 0)))
    gate = payload.get("gate")
    if gate and Path(gate).exists():
        raise PermanentError(f"gate {gate} is closed")
    return {"i": payload.get("i")}
