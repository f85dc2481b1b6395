"""The task registry: names the API accepts and the functions workers run.

Applications register their own with the decorator:

    from jobs.tasks import task, PermanentError

    @task("resize-image")
    def resize(payload, ctx):
        ...

in the `tasks` module of an installed app (every process imports those) or in a
module listed in JOBS_TASK_MODULES.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.utils.module_loading import autodiscover_modules

from jobs.conf import settings
from jobs.retries import PermanentError, RetryableError, RetryPolicy

# Defined beside the retry policy they override; their public name, in error paths and
# pickles alike, is jobs.tasks.*, as it always was.
PermanentError.__module__ = RetryableError.__module__ = __name__


class InvalidPayload(PermanentError):
    """The payload does not fit the task; raised by validators, rejected by the API."""


_stop_lock = threading.Lock()

MAX_PROGRESS_MESSAGE = 500


class _StopEvent(threading.Event):
    """An Event that remembers whether the handler saw it set: a cancel request the
    handler saw ends the job "cancelled"; one it never looked at came too late."""

    observed = False

    def is_set(self) -> bool:
        if super().is_set():
            self.observed = True
            return True
        return False

    def wait(self, timeout: float | None = None) -> bool:
        if super().wait(timeout):
            self.observed = True
            return True
        return False


def _number(value: Any, name: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise TypeError(f"progress {name} must be a number, not {value!r}")
    if value < 0 or value in (float("inf"), float("-inf")):
        raise ValueError(f"progress {name} must be a finite number >= 0, not {value!r}")
    return value


def _storable_text(text: str) -> str:
    """What jsonb can store: no NUL, no lone surrogate (a refused report would take the
    heartbeat of every job on the worker down with it)."""
    return text.replace("\x00", "").encode("utf-8", "replace").decode("utf-8")


@dataclass
class JobContext:
    """What a handler knows about the attempt it runs.

    `stop` is set when the worker lost authority over the job (a heartbeat was
    fenced off), is shutting down, someone cancelled the job (`cancelled`) or the
    attempt reached its timeout (`timed_out`): long handlers should check it and
    return. `progress()` reports how far along
    the attempt is; the worker writes the latest report with its heartbeat.
    """

    job_id: int
    lease_version: int
    attempt: int
    worker_id: str
    queue: str
    task: str
    lost_authority: bool = False
    # Set by the worker's watchdog when the attempt reached its timeout (the soft stop):
    # the attempt ends failed with a `timeout:` error whatever the handler returns.
    timed_out: bool = False
    _stop: _StopEvent | None = field(default=None, repr=False, compare=False)
    _cancel_requested: bool = field(default=False, repr=False, compare=False)
    _cancel_seen: bool = field(default=False, repr=False, compare=False)
    # (sequence number, report): replaced whole, so the heartbeat thread reads a pair.
    _progress: tuple[int, dict[str, Any]] | None = field(default=None, repr=False, compare=False)

    @property
    def stop(self) -> threading.Event:
        # Created on first use: most handlers never look at it, and an Event per job
        # was a fifth of a busy worker's CPU.
        event = self._stop
        if event is None:
            with _stop_lock:
                if self._stop is None:
                    self._stop = _StopEvent()
                event = self._stop
        return event

    @property
    def cancelled(self) -> bool:
        """True once someone asked to cancel this job: return (or raise) and it ends
        failed with error "cancelled"."""
        if self._cancel_requested:
            self._cancel_seen = True
        return self._cancel_requested

    def time_out(self) -> None:
        """Called by the worker's watchdog when the attempt reached its timeout."""
        self.timed_out = True
        self.stop.set()

    def request_cancel(self) -> None:
        """Called by the worker when its heartbeat learns of a cancel request."""
        self._cancel_requested = True
        self.stop.set()

    @property
    def cancel_seen(self) -> bool:
        """A cancel was requested and the handler looked at `cancelled` or `stop` since."""
        return self._cancel_requested and (
            self._cancel_seen or (self._stop is not None and self._stop.observed)
        )

    def sleep(self, seconds: float) -> bool:
        """Sleep cooperatively; returns False when told to stop early."""
        return not self.stop.wait(seconds)

    def progress(self, done: float, total: float | None = None, message: str = "") -> None:
        """Report how far along the attempt is: `done` of `total` (unknown: None).

        Cheap: it only records the latest value; the worker writes it with its
        fenced heartbeat, at most once per JOBS_PROGRESS_INTERVAL per job.
        """
        report: dict[str, Any] = {
            "done": _number(done, "done"),
            "total": None if total is None else _number(total, "total"),
            "message": _storable_text(str(message)[:MAX_PROGRESS_MESSAGE]),
        }
        seq = self._progress[0] + 1 if self._progress is not None else 1
        self._progress = (seq, report)


Handler = Callable[[Any, JobContext], Any]
Validator = Callable[[Any], None]


@dataclass(frozen=True)
class TaskSpec:
    name: str
    fn: Handler
    transactional: bool = False
    validate: Validator | None = None
    durable: bool = False
    timeout: float | None = None  # seconds an attempt may run; None: the job's or the default
    public: bool = True
    example: bool = False  # a test or example task: never public unless named (D196)
    retry: RetryPolicy | None = None  # retry_on / give_up_on / backoff (jobs.retries)


_registry: dict[str, TaskSpec] = {}
_loaded = False
_load_lock = threading.Lock()


def task(
    name: str | None = None,
    *,
    transactional: bool = False,
    validate: Validator | None = None,
    durable: bool = False,
    timeout: float | None = None,
    public: bool = True,
    example: bool = False,
    retry_on: tuple[type[BaseException], ...] | None = None,
    give_up_on: tuple[type[BaseException], ...] | None = None,
    backoff: Callable[[int], float] | tuple[float, float, float] | None = None,
) -> Callable[[Handler], Handler]:
    """Register a handler `fn(payload, ctx)`.

    transactional=True runs the handler inside the database transaction of its
    fenced completion: its own writes commit only if the worker still holds the
    lease when it finishes, so a stale worker's side effects roll back with its
    rejected result (exactly-once effects inside PostgreSQL).
    validate(payload) raises InvalidPayload for payloads the task cannot run;
    the API calls it before accepting a job.
    durable=True makes `ctx.sleep()` park the job instead of holding the worker
    (jobs.durable); `ctx.step()` and `ctx.wait_for_signal()` work in any
    non-transactional handler.
    timeout=SECONDS bounds each attempt (a job's own `timeout` wins; without either,
    JOBS_DEFAULT_TIMEOUT): `ctx.stop` is set and `ctx.timed_out` is true at the limit,
    and an attempt still running JOBS_TIMEOUT_GRACE seconds later is ended as failed.
    public=False keeps the task off the API: a client cannot submit it (it answers
    `unknown_task` like a name that does not exist) unless JOBS_PUBLIC_TASKS names it.
    example=True marks a test or example task (the built-ins, the demo app's, the fault
    suite's): internal whatever `public` says, so that installing the app that holds it
    never opens it to clients; JOBS_PUBLIC_TASKS opens it by name (D196).
    retry_on=(Exc, ...) retries only those (and RetryableError); any other exception
    fails the job at once. give_up_on=(Exc, ...) fails at once on those, before
    retry_on. backoff=(base, max, jitter) waits min(max, base × 2^(retry-1)) seconds
    less up to `jitter` × that at random, or backoff=f(retry) -> seconds. Each decision
    is written to the job's history. Without any of them the defaults apply.
    """
    policy = RetryPolicy.build(retry_on, give_up_on, backoff)
    if durable and transactional:
        raise ValueError("a durable task cannot be transactional: its checkpoints commit alone")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0
    ):
        raise ValueError(f"timeout must be a number of seconds > 0, not {timeout!r}")

    def register(fn: Handler) -> Handler:
        key = name or fn.__name__
        existing = _registry.get(key)
        if existing is not None and existing.fn is not fn:
            raise ValueError(f"task {key!r} is already registered")
        _registry[key] = TaskSpec(
            key,
            fn,
            transactional,
            validate,
            durable,
            timeout,
            public and not example,
            example,
            retry=policy,
        )
        return fn

    return register


def load() -> dict[str, TaskSpec]:
    """Import the built-ins, every module in JOBS_TASK_MODULES and the `tasks` module of
    every installed app (as Celery finds them: a project's `shop/tasks.py` needs no
    setting, D113), once."""
    global _loaded
    if not _loaded:
        with _load_lock:
            if not _loaded:
                for module in settings.JOBS_TASK_MODULES:
                    importlib.import_module(module)
                autodiscover_modules("tasks")
                _loaded = True
    return _registry


def get(name: str) -> TaskSpec | None:
    return load().get(name)


def names() -> list[str]:
    return sorted(load())


def is_public(name: str) -> bool:
    """A client may submit it: registered public, or made so by JOBS_PUBLIC_TASKS."""
    spec = get(name)
    return spec is not None and _public(name, spec)


def _public(name: str, spec: TaskSpec) -> bool:
    return spec.public or name in settings.JOBS_PUBLIC_TASKS


def submittable(name: str, *, for_client: bool = False) -> TaskSpec | None:
    """The task a submission names, or None when it may not: unknown, or (for a client)
    not public. One look-up for the submission's rules (jobs.validation)."""
    spec = get(name)
    if spec is None or not for_client or _public(name, spec):
        return spec
    return None


def public_names() -> list[str]:
    """What an `unknown_task` error may list: internal names never appear."""
    return [name for name in names() if is_public(name)]


def job_of(target: Any, payload: Any = None, args: Any = None, kwargs: Any = None) -> dict:
    """What a schedule or a workflow step runs (D223): a Django task object as its
    backend's `enqueue` would submit it, with `args` and `kwargs`; else a task name (None
    for a handler, named when synced) with its payload."""
    get_backend = getattr(target, "get_backend", None)
    if callable(get_backend):  # a Django Task: its backend, not this module, knows it
        if payload is not None:
            raise TypeError(
                f"{target.module_path} is a Django task: give its arguments as args= and "
                "kwargs=, not a payload"
            )
        job_fields = getattr(get_backend(), "job_fields", None)
        if job_fields is None:
            raise TypeError(
                f"{target.module_path} uses the Tasks backend {target.backend!r}: only "
                "jobs.backends.JobServiceBackend's tasks run as jobservice jobs"
            )
        return job_fields(target, args or (), kwargs or {})
    if args is not None or kwargs is not None:
        raise TypeError("args= and kwargs= are for a Django task object; give a payload")
    name = target if isinstance(target, str) else None
    return {"task": name, "payload": {} if payload is None else payload}


# --- built-in tasks (SPEC §9) -------------------------------------------------------


# Test and example tasks: registered everywhere (SPEC §9), public nowhere unless
# JOBS_PUBLIC_TASKS names them (D196).
@task("echo", example=True)
def echo(payload: Any, ctx: JobContext) -> Any:
    """Return the payload unchanged."""
    return payload


MAX_SLEEP_SECONDS = 3600


def _validate_sleep(payload: Any) -> None:
    if not isinstance(payload, dict) or "seconds" not in payload:
        raise InvalidPayload('sleep needs {"seconds": <number>}')
    seconds = payload["seconds"]
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise InvalidPayload("seconds must be a number")
    if not 0 <= seconds <= MAX_SLEEP_SECONDS:
        raise InvalidPayload(f"seconds must be between 0 and {MAX_SLEEP_SECONDS}")


# Its own timeout: the longest sleep it accepts, and a little more.
@task("sleep", validate=_validate_sleep, timeout=MAX_SLEEP_SECONDS + 60, example=True)
def sleep(payload: dict, ctx: JobContext) -> dict:
    """Sleep `seconds`, waking early when cancelled, when the worker lost the job or
    when it stops (`ctx.stop`)."""
    started = time.monotonic()
    finished = ctx.sleep(float(payload["seconds"]))
    if not finished:
        raise RetryableError("interrupted before the sleep ended")
    return {"slept": round(time.monotonic() - started, 3)}


@task("fail", example=True)
def fail(payload: Any, ctx: JobContext) -> Any:
    """Always raise a retryable error (for testing retries and the failed state)."""
    message = payload.get("message") if isinstance(payload, dict) else None
    raise RetryableError(message or "fail task always fails")
