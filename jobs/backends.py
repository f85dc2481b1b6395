"""jobservice as a backend for Django's Tasks framework (DEP 14).

    TASKS = {"default": {"BACKEND": "jobs.backends.JobServiceBackend", "QUEUES": ["default"]}}

A task enqueued here is an ordinary job: `enqueue` goes through
`jobs.submission.submit` (validation, backpressure, idempotency, the caller's
transaction, the Redis push after commit) and `runworker` runs it with the same
fencing, heartbeats, retries, reaper and admin as any other job.

The job's task name is the task's import path (e.g. `shop.tasks.send_receipt`):
each @task of this backend registers one handler under that name in the task
registry (jobs.tasks), so the admin, the metrics and the logs name the real task,
and `runworker` runs it as soon as its module is in JOBS_TASK_MODULES.
The payload holds the arguments: {"args": [...], "kwargs": {...}}.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import json
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import InterfaceError, OperationalError, connection, transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from jobs import cancelling, queues, waiting
from jobs import tasks as registry
from jobs.cancelling import CancelOutcome
from jobs.lifecycle import CANCELLED, Status
from jobs.models import Job, JobEvent
from jobs.queues import QUEUE_NAME_RE
from jobs.retries import RetryPolicy
from jobs.submission import InvalidSubmission, submit
from jobs.tasks_compat import (
    BaseTaskBackend,
    Task,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_enqueued,
    task_finished,
    task_started,
)

STATUS_MAP = {
    Status.QUEUED: TaskResultStatus.READY,
    Status.ENQUEUE_FAILED: TaskResultStatus.READY,
    Status.PROCESSING: TaskResultStatus.RUNNING,
    Status.DONE: TaskResultStatus.SUCCESSFUL,
    Status.FAILED: TaskResultStatus.FAILED,
}
WORKER_ACTOR_PREFIX = "worker:"
# The payload's key for the run_after a task was enqueued with (its args and kwargs
# beside it): the job's run_at moves with retries.
RUN_AFTER_KEY = "run_after"


class InvalidTaskArguments(InvalidSubmission, TypeError):
    """The arguments would not come back the same from JSON; nothing was enqueued."""


class AttemptLost(Exception):
    """Stands in `TaskResult.errors` for an attempt that ended without an exception of
    the task's own: its lease expired (the worker died or stalled) or staff revoked it."""


class JobCancelled(Exception):
    """Stands in `TaskResult.errors` for the cancel that ended the job: of a job that
    had not started (its only entry then) or of a running one that stopped on it."""


# --- retry policy ---------------------------------------------------------------------

_MAX_RETRIES_ATTR = "jobservice_max_retries"
_TIMEOUT_ATTR = "jobservice_timeout"


def _marker(attr: str, value: Any) -> Callable[[Callable], Callable]:
    """Set `attr` on the task's function, above or under @task alike: a Task is frozen,
    and Task.using() copies share its function (D224)."""

    def mark(fn: Callable) -> Callable:
        setattr(fn.func if isinstance(fn, Task) else fn, attr, value)
        return fn

    return mark


def retries(max_retries: int) -> Callable[[Callable], Callable]:
    """Declare a task's retry budget; above or under @task:

        @task
        @retries(5)
        def send_receipt(order_id): ...

    Without it the backend's OPTIONS["MAX_RETRIES"] applies, else JOBS_MAX_RETRIES.
    A task raises jobs.tasks.PermanentError to fail at once without a retry.
    """
    return _marker(_MAX_RETRIES_ATTR, max_retries)


_RETRY_POLICY_ATTR = "jobservice_retry_policy"


def retry_policy(
    *,
    retry_on: tuple[type[BaseException], ...] | None = None,
    give_up_on: tuple[type[BaseException], ...] | None = None,
    backoff: Callable[[int], float] | tuple[float, float, float] | None = None,
) -> Callable[[Callable], Callable]:
    """Which exceptions retry and how long between tries (the Task API has no argument
    for it); above or under @task, checked at import as `jobs.tasks.task`'s are:

        @task
        @retry_policy(retry_on=(TimeoutError,), backoff=(2.0, 60.0, 0.1))
        def fetch_rates(day): ...
    """
    return _marker(_RETRY_POLICY_ATTR, RetryPolicy.build(retry_on, give_up_on, backoff))


def timeout(seconds: float) -> Callable[[Callable], Callable]:
    """Bound each attempt of a task (the Task API has no argument for it); above or
    under @task:

        @task
        @timeout(30)
        def render_invoice(order_id): ...

    At the limit the context's `stop` is set; JOBS_TIMEOUT_GRACE seconds later the
    attempt ends failed with a `timeout:` error and is retried per the budget.
    Without it JOBS_DEFAULT_TIMEOUT applies.
    """
    return _marker(_TIMEOUT_ATTR, seconds)


def wait(result: TaskResult, timeout: float) -> TaskResult:
    """Block up to `timeout` seconds until `result`'s task finished; the result as it is
    then (TaskResult is the framework's frozen dataclass: a new one comes back).

        result = wait(send_receipt.enqueue(order.pk), timeout=10)
    """
    return result.task.get_backend().wait_result(result.id, timeout)


# --- idempotency ----------------------------------------------------------------------

_idempotency_key: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jobservice_idempotency_key", default=None
)


@contextlib.contextmanager
def idempotency_key(key: str) -> Iterator[None]:
    """Enqueue at most once per key: the Task API has no argument for it.

        with idempotency_key(f"receipt-{order.pk}"):
            send_receipt.enqueue(order.pk)

    A repeat with the same arguments returns the first result; different arguments
    under the same key raise jobs.submission.IdempotencyConflict.
    """
    token = _idempotency_key.set(key)
    try:
        yield
    finally:
        _idempotency_key.reset(token)


_flow: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "jobservice_flow", default=None
)


@contextlib.contextmanager
def flow(**fields: Any) -> Iterator[None]:
    """Flow control for the tasks enqueued inside (the Task API has no argument for
    it): `concurrency_key` and the flow fields of a submission (docs/queue-controls.md).

        with flow(debounce_key=f"reindex-{doc.pk}", debounce_seconds=5):
            reindex.enqueue(doc.pk)
    """
    token = _flow.set(fields)
    try:
        yield
    finally:
        _flow.reset(token)


# --- arguments ------------------------------------------------------------------------


def _arguments(args: Iterable[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The payload, refused unless JSON gives back exactly what the task was called with
    (tuples aside, which come back as lists as in every Tasks backend)."""
    payload = {"args": list(args), "kwargs": dict(kwargs)}
    try:
        decoded = json.loads(json.dumps(payload, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidTaskArguments(
            f"task arguments must be JSON round-trippable: {exc}",
            field="payload",
            code="invalid_payload",
        ) from exc
    if decoded != _lists(payload):
        raise InvalidTaskArguments(
            "task arguments must be JSON round-trippable (e.g. dict keys must be strings)",
            field="payload",
            code="invalid_payload",
        )
    return decoded


def _lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_lists(v) for v in value]
    return value


# --- the worker side ------------------------------------------------------------------

_handlers: dict[str, registry.Handler] = {}


def _register(path: str, policy: RetryPolicy | None = None) -> None:
    """One handler per import path, registered once (Task.using() makes new Task
    objects for the same function; they share it)."""
    if path in _handlers:
        return
    _handlers[path] = handler = _handler_for(path)
    # Enqueued from code, never by a client; a workflow step or schedule naming the path
    # is held to the payload the handler reads (D223).
    options = {} if policy is None else {
        "retry_on": policy.retry_on, "give_up_on": policy.give_up_on, "backoff": policy.backoff
    }  # fmt: skip
    registry.task(path, public=False, validate=_check_payload, **options)(handler)


_PAYLOAD_KEYS = frozenset({"args", "kwargs", RUN_AFTER_KEY})


def _check_payload(payload: Any) -> None:
    if (
        not isinstance(payload, dict)
        or not set(payload) <= _PAYLOAD_KEYS
        or not isinstance(payload.get("args", []), list)
        or not isinstance(payload.get("kwargs", {}), dict)
        or not isinstance(payload.get(RUN_AFTER_KEY, ""), str)
    ):
        raise registry.InvalidPayload(
            'a Django task\'s payload is {"args": [...], "kwargs": {...}}: give the task '
            "object and its arguments (Workflow.step(id, task, args=..., kwargs=...), "
            "@periodic(..., args=..., kwargs=...))"
        )


def _handler_for(path: str) -> registry.Handler:
    def run(payload: dict[str, Any], ctx: registry.JobContext) -> Any:
        task = import_string(path)
        if not isinstance(task, Task):
            raise registry.PermanentError(f"{path} is no longer a task")
        backend = task.get_backend()
        job = _read_job(ctx.job_id)
        result = backend._result(job, task)
        object.__setattr__(result, "status", TaskResultStatus.RUNNING)
        task_started.send(type(backend), task_result=result)
        return _call(task, backend, job, result, payload, ctx)

    run.__name__ = run.__qualname__ = f"run[{path}]"
    return run


def _read_job(job_id: int) -> Job:
    """The job, on a fresh session if this handler thread's one is gone (ended while
    idle by a restarted or failed-over PostgreSQL, or broken by the previous task):
    handler threads keep their session between jobs, and a dead one must not cost
    this task an attempt."""
    try:
        return Job.objects.get(pk=job_id)
    except (OperationalError, InterfaceError):
        connection.close()
        return Job.objects.get(pk=job_id)


@dataclass(frozen=True, kw_only=True)
class JobTaskContext(TaskContext):
    """The framework's context, plus what a jobservice attempt offers every handler:
    progress reports written with the fenced heartbeat, and cooperative stop/cancel
    (the attempt's JobContext; D40, D39)."""

    job: registry.JobContext = field(repr=False, compare=False)

    def progress(self, done: float, total: float | None = None, message: str = "") -> None:
        self.job.progress(done, total, message)

    @property
    def stop(self) -> threading.Event:
        return self.job.stop

    @property
    def cancelled(self) -> bool:
        return self.job.cancelled

    @property
    def parent_results(self) -> dict[str, Any]:
        """In a workflow step: {parent step id: its return value} of the done parents."""
        return self.job.parent_results

    @property
    def failed_parents(self) -> dict[str, str]:
        """In a workflow step under on_failure=continue: {parent step id: its error}."""
        return self.job.failed_parents


def _call(
    task: Task,
    backend: BaseTaskBackend,
    job: Job,
    result: TaskResult,
    payload: dict[str, Any],
    ctx: registry.JobContext,
) -> Any:
    """Run the task function for one attempt; task_finished when no retry follows."""
    from jobs.worker import check_result  # the worker's own rule; not loaded by the API

    args, kwargs = payload.get("args", []), payload.get("kwargs", {})
    try:
        if task.takes_context:
            value = task.call(JobTaskContext(task_result=result, job=ctx), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
        value = check_result(value)  # a value jsonb cannot hold fails the task for good
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: a failed attempt too
        policy = getattr(task.func, _RETRY_POLICY_ATTR, None)
        final = (
            isinstance(exc, registry.PermanentError)
            or ctx.attempt > job.max_retries
            or (policy is not None and policy.decide(exc, ctx.attempt).give_up)
        )
        if final:  # no retry follows: the task is finished, as FAILED
            object.__setattr__(result, "status", TaskResultStatus.FAILED)
            object.__setattr__(result, "finished_at", timezone.now())
            result.errors.append(
                TaskError(
                    exception_class_path=_class_path(type(exc)),
                    traceback=_traceback(exc),
                )
            )
            task_finished.send(type(backend), task_result=result)
        raise
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "finished_at", timezone.now())
    object.__setattr__(result, "_return_value", value)
    task_finished.send(type(backend), task_result=result)
    return value


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _traceback(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


# --- errors from the history ----------------------------------------------------------


def _errors_from_history(events: list[JobEvent]) -> list[TaskError]:
    """One TaskError per attempt that ended with an error, oldest first: the exception's
    class path and traceback as the worker stored them with the attempt (D29). An attempt
    that ended without an exception of the task (a lease expiry, its worker gone, staff)
    reads as AttemptLost, with the recorded error as its text; a cancel, running or not
    started, as JobCancelled (D222)."""
    return [
        TaskError(
            exception_class_path=_error_class(event),
            traceback=event.error_traceback or event.error,
        )
        for event in events
        if event.kind == JobEvent.TRANSITION
        and event.error
        and (
            event.from_status == Status.PROCESSING
            or (event.to_status == Status.FAILED and event.error == CANCELLED)
        )
    ]


def _error_class(event: JobEvent) -> str:
    if event.error == CANCELLED:  # whatever the handler raised on its way out
        return _class_path(JobCancelled)
    return event.error_class or _class_path(AttemptLost)


# --- the backend ----------------------------------------------------------------------


class JobTaskResult(TaskResult):
    """Django's TaskResult with `cancel()`: the library's dataclass is frozen and has no
    such method, so this backend's results are of this subclass (no field added)."""

    __slots__ = ()

    def cancel(self) -> CancelOutcome:
        """Cancel the task as the API does (jobs.cancelling), then refresh the result:
        READY → FAILED at once; RUNNING → stays RUNNING, the worker stops it; a finished
        task raises `jobs.exceptions.NotCancellable`."""
        outcome = self.task.get_backend().cancel(self.id)
        self.refresh()
        return outcome


class JobServiceBackend(BaseTaskBackend):
    """Tasks as jobservice jobs: durable, fenced, retried, reaped."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def validate_task(self, task: Task) -> None:
        super().validate_task(task)
        _register(task.module_path, getattr(task.func, _RETRY_POLICY_ATTR, None))

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Submit the task as a job in the caller's transaction; task_enqueued is sent
        when that transaction commits (never for a task that was rolled back)."""
        fields = self.job_fields(task, args, kwargs)
        if task.run_after is not None:  # kept so that a result read back carries it
            fields["payload"][RUN_AFTER_KEY] = task.run_after.isoformat()
        job, created = submit(
            **fields,
            run_at=task.run_after,
            idempotency_key=_idempotency_key.get(),
            **(_flow.get() or {}),
        )
        if not created:  # a replay, or a debounced task joined: that job's result as it is now
            return self._result(job, task)
        result = self._result(job, task, events=[])
        transaction.on_commit(lambda: task_enqueued.send(type(self), task_result=result))
        return result

    def get_result(self, result_id: str) -> TaskResult:
        """The job's TaskResult. Only paths registered by @task are imported, never a
        string merely read from the table."""
        try:
            job = Job.objects.get(pk=int(result_id))
        except (ValueError, TypeError, Job.DoesNotExist) as exc:
            raise TaskResultDoesNotExist(result_id) from exc
        registry.load()  # JOBS_TASK_MODULES: their @task functions register themselves
        if job.task not in _handlers:  # an ordinary job, or a task this process never saw
            raise TaskResultDoesNotExist(result_id)
        return self._result(job, import_string(job.task))

    def cancel(self, result_id: str) -> CancelOutcome:
        """Cancel the task's job (`jobs.cancelling.cancel`); the result's own `cancel()`."""
        try:
            return cancelling.cancel(int(result_id))
        except (ValueError, TypeError, Job.DoesNotExist) as exc:
            raise TaskResultDoesNotExist(result_id) from exc

    def wait_result(self, result_id: str, timeout: float) -> TaskResult:
        """The result once its job ended, or as it is after `timeout` seconds: woken by
        the workers' announcement, not by polling (jobs.waiting)."""
        try:
            waiting.wait_for(int(result_id), timeout)
        except (ValueError, TypeError, Job.DoesNotExist) as exc:
            raise TaskResultDoesNotExist(result_id) from exc
        return self.get_result(result_id)

    def check(self, **kwargs: Any) -> Iterable[checks.CheckMessage]:
        try:
            declared = queues.declared()
        except ImproperlyConfigured:  # jobs.E103 says what is wrong with JOBS_QUEUES
            declared = None
        for queue in sorted(self.queues):
            if not QUEUE_NAME_RE.fullmatch(queue):
                yield checks.Error(
                    f"TASKS[{self.alias!r}]['QUEUES'] holds {queue!r}, not a valid queue name",
                    hint="1-100 characters of letters, digits, '_', '.', ':' or '-'.",
                    id="jobs.E101",
                )
            elif declared is not None and queue not in declared:
                yield checks.Error(
                    f"TASKS[{self.alias!r}]['QUEUES'] holds {queue!r}, not in JOBS_QUEUES",
                    hint="Declare the queue in JOBS_QUEUES or remove it from QUEUES.",
                    id="jobs.E102",
                )

    def job_fields(self, task: Task, args: Any, kwargs: Any) -> dict[str, Any]:
        """What `task.enqueue(*args, **kwargs)` submits (task name, payload, queue,
        priority, max_retries, timeout): also what a workflow step or a schedule given
        the task object runs (jobs.tasks.job_of). Arguments JSON would change are
        refused here, when the step or schedule is written (D223)."""
        self.validate_task(task)
        return {
            "task": task.module_path,
            "payload": _arguments(args, kwargs),
            "queue": task.queue_name,
            "priority": task.priority,
            "max_retries": self._max_retries(task),
            "timeout": getattr(task.func, _TIMEOUT_ATTR, None),
        }

    def _max_retries(self, task: Task) -> int | None:
        declared = getattr(task.func, _MAX_RETRIES_ATTR, None)
        if declared is not None:
            return declared
        return self.options.get("MAX_RETRIES")

    def _result(self, job: Job, task: Task, events: list[JobEvent] | None = None) -> TaskResult:
        """The TaskResult of a job, its attempts read from the history."""
        if events is None:
            events = list(JobEvent.objects.filter(job_id=job.pk).order_by("id"))
        claims = [
            e for e in events if e.to_status == Status.PROCESSING and e.kind == JobEvent.TRANSITION
        ]
        payload = job.payload if isinstance(job.payload, dict) else json.loads(job.payload)
        run_after = payload.get(RUN_AFTER_KEY)
        # The task as it was enqueued, not the decorator's defaults (D112); not checked
        # again (replace() would): it was valid when enqueued, whatever TASKS says now.
        task = copy.copy(task)
        for name, value in (
            ("priority", job.priority),
            ("queue_name", job.queue),
            ("run_after", datetime.fromisoformat(run_after) if run_after else None),
            ("backend", self.alias),
        ):
            object.__setattr__(task, name, value)
        result = JobTaskResult(
            task=task,
            id=str(job.pk),
            status=STATUS_MAP[Status(job.status)],
            enqueued_at=job.created_at,
            started_at=claims[0].at if claims else None,
            finished_at=job.finished_at,
            last_attempted_at=claims[-1].at if claims else None,
            args=payload.get("args", []),
            kwargs=payload.get("kwargs", {}),
            backend=self.alias,
            errors=_errors_from_history(events),
            worker_ids=[e.actor.removeprefix(WORKER_ACTOR_PREFIX) for e in claims],
        )
        if job.status == Status.DONE:
            object.__setattr__(result, "_return_value", job.result)
        return result
