"""Traces, error reports and log fields of the job pipeline (docs/observability.md).

The pipeline calls these hooks whatever the deployment. With no OpenTelemetry SDK
configured and no Sentry client active, each returns after one check (D302): the
submission, the claim and the write-back do what they did before.

An attempt's span and its error report wait for the write-back: only then is it known
whether the attempt's outcome landed (retry or failure) or was fenced off (a stale write,
which reports nothing).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobs import selectors
from jobs.lifecycle import Status
from jobs.observability import errors, tracing
from jobs.observability.context import running_job

if TYPE_CHECKING:
    from jobs.services import Lease

MAX_WAITING = 10_000  # attempts awaiting their write-back; past it the oldest are dropped


@dataclass(slots=True)
class _Attempt:
    lease: Lease
    span: Any = None
    exc: BaseException | None = None
    error_type: str | None = None


_attempts: dict[tuple[int, int], _Attempt] = {}
_lock = threading.Lock()


def _key(lease: Lease) -> tuple[int, int]:
    return (lease.job_id, lease.lease_version)


def watching() -> bool:
    return tracing.tracer() is not None or errors.active()


# --- submission ---------------------------------------------------------------------


def link_context() -> str | None:
    """The trace context a schedule keeps for the jobs it fires: a link, not a parent
    (D306), so each firing is a trace of its own."""
    return tracing.as_link(tracing.current())


# --- attempts -----------------------------------------------------------------------


class attempt:
    """Around one attempt's handler in its thread: the log fields, and with tracing on
    the process span as the handler's current span (ended at the write-back)."""

    __slots__ = ("lease", "log_token", "span_token")

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.span_token = None

    def __enter__(self) -> attempt:
        lease = self.lease
        self.log_token = running_job.set((lease.job_id, lease.task))
        if not watching():
            return self
        record = _Attempt(lease)
        if tracing.tracer() is not None:
            record.span = tracing.process_span(
                lease.queue, lease.task, lease.job_id, lease.retry_count + 1,
                lease.lease_version, selectors.trace_context(lease.job_id),
            )  # fmt: skip
            self.span_token = tracing.attach(record.span)
        with _lock:
            if len(_attempts) >= MAX_WAITING:  # write-backs given up on: forget the oldest
                _attempts.pop(next(iter(_attempts)))
            _attempts[_key(lease)] = record
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if self.span_token is not None:
            tracing.detach(self.span_token)
        running_job.reset(self.log_token)


def failed(lease: Lease, exc: BaseException, error_type: str | None) -> None:
    """The handler raised `exc`: kept for the report once the write-back says more."""
    if not _attempts:
        return
    record = _attempts.get(_key(lease))
    if record is None:
        return
    record.exc, record.error_type = exc, error_type or type(exc).__qualname__
    if record.span is not None:
        tracing.failed(record.span, exc, record.error_type)


def ended(lease: Lease, outcome: str, status: str | None = None, stale: bool = False) -> None:
    """The attempt's outcome is written (`status` its job's status now), settled by the
    handler itself, or fenced off (`stale`)."""
    if not _attempts:
        return
    with _lock:
        record = _attempts.pop(_key(lease), None)
    if record is None:
        return
    will_retry = status == Status.QUEUED and outcome == "fail"  # requeued for another attempt
    if record.span is not None:
        tracing.settled(record.span, outcome, status, will_retry, stale)
    if record.exc is not None and not stale and status in (Status.QUEUED, Status.FAILED):
        if errors.active():
            errors.report(record.exc, tags(lease), will_retry=will_retry)


def written(batch: list, done: dict, failed_rows: dict, stale: list) -> None:
    """A write-back batch landed: each attempt's span ends, failures are reported."""
    if not _attempts:
        return
    fenced = {_key(lease) for lease in stale}
    for o in batch:
        lease = o.lease
        if _key(lease) in fenced:
            ended(lease, str(o.kind), stale=True)
        elif lease.job_id in failed_rows:
            ended(lease, str(o.kind), failed_rows[lease.job_id].status)
        elif lease.job_id in done:
            ended(lease, str(o.kind), Status.DONE)
        else:
            ended(lease, str(o.kind))


def tags(lease: Lease) -> dict[str, Any]:
    return {
        "job_id": lease.job_id,
        "task": lease.task,
        "queue": lease.queue,
        "attempt": lease.retry_count + 1,
        "lease_version": lease.lease_version,
        "worker_id": lease.worker_id,
    }


# --- steps and outgoing calls ---------------------------------------------------------


def step(name: str) -> tracing.Step:
    """`with step(name):` around a durable step's function: its child span."""
    return tracing.Step(name)


def http_call(method: str, url: str, headers: dict[str, str]) -> tracing.HttpCall:
    """`with http_call("POST", url, headers) as call:` a CLIENT span whose context goes
    out in `headers` (`traceparent`); `call.answered(code)` records the answer."""
    return tracing.HttpCall(method, url, headers)


def record_headers(stored: str | None) -> list[tuple[str, bytes]]:
    """Kafka record headers carrying a job's trace context on."""
    if not stored or stored.startswith(tracing.LINK):
        return []
    return [(k, v.encode()) for k, v in tracing.decode(stored).items()]
