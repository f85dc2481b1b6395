"""Durable jobs: step checkpoints and waits that do not hold a worker (issue 17).

A handler's `ctx.step(name, fn, ...)` runs `fn` at most once per job across
attempts once its checkpoint committed: the result is written under the job's
fence (jobs.services.checkpoint_step), and a later attempt gets it back without
calling `fn`. A step whose function ran but whose checkpoint did not commit (a
crash, a lost lease) runs again: at-least-once per step, exactly-once per
committed step. A stale worker's checkpoint is refused like its completion; the
attempt then ends without writing anything else.

`ctx.sleep(s)` (in tasks registered `durable=True`) and `ctx.wait_for_signal(key)`
park the job: the attempt ends, the job goes back to queued with a future run_at
and a lease bump, no retry spent, and the handler replays from the top when it
runs again (completed steps return at once). Waits are checkpoints too (names
starting with "~"), so a replay knows where it stopped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import DatabaseError, DataError, InterfaceError, connection

from jobs import metrics, selectors, services, tasks
from jobs.conf import settings
from jobs.lifecycle import BLOCKED_RUN_AT, WaitReason
from jobs.observability import hooks
from jobs.services import Lease
from jobs.tasks import JobContext, PermanentError

log = logging.getLogger(__name__)

WAIT_PREFIX = "~"  # checkpoints of the job's own waits; user step names may not start so
MAX_STEP_NAME = 200


def max_steps() -> int:
    return int(settings.JOBS_MAX_STEPS)


class StepError(PermanentError):
    """A step the job cannot go on with (bad name, too many, unstorable result): the
    job fails at once; running it again would fail the same way."""


class SignalTimeout(PermanentError):
    """`wait_for_signal` gave up: no signal came before the timeout. Catch it to go on
    without the signal; uncaught, the job fails at once."""

    def __init__(self, key: str, timeout: float | None) -> None:
        super().__init__(f"signal {key!r} did not arrive within {timeout} s")
        self.key = key


class Suspend(BaseException):
    """Raised by a wait to end the attempt and park the job. A BaseException, so that a
    handler's `except Exception` cannot swallow it."""

    def __init__(
        self,
        reason: WaitReason,
        *,
        key: str | None = None,
        seconds: float | None = None,
        until: datetime | str | None = None,
        checkpoint: str | None = None,
    ) -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.key = key
        self.seconds = seconds
        self.until = until
        self.checkpoint = checkpoint


class FencedOff(BaseException):
    """A checkpoint the fence refused: this worker lost the job; the attempt ends."""


def _json(name: str, value: Any) -> str:
    """The step result as JSON text that jsonb accepts, or a StepError saying why not."""
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise StepError(f"step {name!r} result cannot be stored: not JSON ({exc})") from None
    if "\\u0000" in text:
        raise StepError(f"step {name!r} result cannot be stored: it contains a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise StepError(f"step {name!r} result cannot be stored: not valid UTF-8") from None
    return text


@dataclass
class DurableContext(JobContext):
    """The handler context of every job: JobContext plus steps, waits and, for a
    workflow job, its parents' results. Loads nothing until a step or wait is used."""

    lease: Lease | None = field(default=None, repr=False, compare=False)
    durable: bool = field(default=False, repr=False, compare=False)
    _steps: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    _loaded_at: datetime | None = field(default=None, repr=False, compare=False)
    _names: set[str] | None = field(default=None, repr=False, compare=False)
    _sleeps: int = field(default=0, repr=False, compare=False)
    _parents: tuple[dict, dict] | None = field(default=None, repr=False, compare=False)

    # --- steps -----------------------------------------------------------------------

    def _stored(self) -> dict[str, Any]:
        if self._steps is None:
            self._steps, self._loaded_at = self._read_steps()
        return self._steps

    # The database work of steps and waits, in four methods a process-pool child
    # overrides to ask its parent instead (jobs.worker.pools.child).

    def _read_steps(self) -> tuple[dict[str, Any], datetime | None]:
        return selectors.job_steps(self.job_id)

    def _read_signal(self, key: str) -> tuple[bool, Any]:
        return selectors.job_signal(self.job_id, key)

    def _read_parents(self) -> tuple[dict, dict]:
        return selectors.parent_outcomes(self.job_id)

    def _write_checkpoint(self, name: str, text: str) -> bool:
        """The fenced checkpoint write; False (recorded as a fence rejection) if refused."""
        assert self.lease is not None
        held = services.checkpoint_step(self.lease, name, text)
        if not held:
            services.record_fence_rejections([self.lease], "step")
        return held

    def _claim_name(self, name: str) -> None:
        if self._names is None:
            self._names = set()
        if name in self._names:
            raise StepError(f"step name {name!r} used twice in one run: names must be unique")
        if len(self._names) >= max_steps():
            raise StepError(
                f"step limit reached: a job may have at most {max_steps()} steps "
                "(JOBS_MAX_STEPS); split the work into a workflow"
            )
        self._names.add(name)

    def _checkpoint(self, name: str, value: Any) -> Any:
        if connection.in_atomic_block:
            # Inside a transaction the checkpoint (and a refusal's record) would commit
            # or roll back with it, not alone: a step would not be a step.
            raise StepError(f"step {name!r} inside a transaction: a checkpoint commits alone")
        text = _json(name, value)
        try:
            held = self._write_checkpoint(name, text)
        except DataError as exc:
            raise StepError(f"step {name!r} result refused by PostgreSQL: {exc}") from None
        if not held:
            self.lost_authority = True
            self.stop.set()
            raise FencedOff(name)
        self._stored()[name] = json.loads(text)
        return self._steps[name]  # type: ignore[index]

    def step(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` once per job: its JSON result is checkpointed under
        the job's fence and returned (as stored) on every later attempt without
        calling `fn`. Names are unique within a run and may not start with "~"."""
        if not isinstance(name, str) or not name or len(name) > MAX_STEP_NAME:
            raise StepError(f"a step name is 1-{MAX_STEP_NAME} characters, not {name!r}")
        if name.startswith(WAIT_PREFIX):
            raise StepError(f"step names starting with {WAIT_PREFIX!r} are reserved: {name!r}")
        self._claim_name(name)
        stored = self._stored()
        if name in stored:
            return stored[name]
        with hooks.step(name):
            return self._checkpoint(name, fn(*args, **kwargs))

    # --- waits -------------------------------------------------------------------------

    def _deadline(self, name: str) -> tuple[bool, Any]:
        """(parked before, its deadline or None) for a wait checkpoint."""
        stored = self._stored()
        if name not in stored:
            return False, None
        until = (stored[name] or {}).get("until")
        return True, (datetime.fromisoformat(until) if until else None)

    def sleep(self, seconds: float) -> bool:
        """In a durable task: park the job for `seconds` without holding the worker and
        return True when it runs again. Elsewhere: JobContext's cooperative sleep."""
        if not self.durable:
            return super().sleep(seconds)
        self._sleeps += 1
        name = f"{WAIT_PREFIX}sleep:{self._sleeps}"
        self._claim_name(name)
        parked, until = self._deadline(name)
        if not parked:
            raise Suspend(WaitReason.SLEEP, seconds=max(0.0, float(seconds)), checkpoint=name)
        if until is not None and until <= self._loaded_at:
            return True
        raise Suspend(WaitReason.SLEEP, until=until)

    def wait_for_signal(self, key: str, timeout: float | None = None) -> Any:
        """Park until a signal `key` arrives (or use one that arrived before) and return
        its payload; raise SignalTimeout after `timeout` seconds without one."""
        if not isinstance(key, str) or not key or len(key) > MAX_STEP_NAME - 10:
            raise StepError(f"a signal key is 1-{MAX_STEP_NAME - 10} characters, not {key!r}")
        got = f"{WAIT_PREFIX}signal:{key}"
        wait = f"{WAIT_PREFIX}wait:{key}"
        self._claim_name(got)
        stored = self._stored()
        if got in stored:
            if stored[got].get("timed_out"):
                raise SignalTimeout(key, stored[got].get("timeout"))
            return stored[got].get("payload")
        found, payload = self._read_signal(key)
        if found:
            return self._checkpoint(got, {"payload": payload})["payload"]
        parked, until = self._deadline(wait)
        if parked and until is not None and until <= self._loaded_at:
            self._checkpoint(got, {"timed_out": True, "timeout": timeout})
            raise SignalTimeout(key, timeout)
        if parked:
            raise Suspend(WaitReason.SIGNAL, key=key, until=until or BLOCKED_RUN_AT)
        if timeout is None:
            raise Suspend(WaitReason.SIGNAL, key=key, until=BLOCKED_RUN_AT, checkpoint=wait)
        raise Suspend(WaitReason.SIGNAL, key=key, seconds=max(0.0, float(timeout)), checkpoint=wait)

    # --- workflows ----------------------------------------------------------------------

    def _load_parents(self) -> tuple[dict, dict]:
        if self._parents is None:
            self._parents = self._read_parents()
        return self._parents

    @property
    def parent_results(self) -> dict[str, Any]:
        """For a workflow job: {parent step id: its result} of the parents that are done."""
        return self._load_parents()[0]

    @property
    def failed_parents(self) -> dict[str, str]:
        """For a workflow job under on_failure=continue: {parent step id: its error}."""
        return self._load_parents()[1]


def context(lease: Lease, cls: type[DurableContext] | None = None, **extra: Any) -> DurableContext:
    """The context the worker hands a handler for `lease` (`cls` and `extra`: a
    process-pool child's, jobs.worker.pools.child)."""
    spec = tasks.get(lease.task)
    return (cls or DurableContext)(
        job_id=lease.job_id,
        lease_version=lease.lease_version,
        attempt=lease.retry_count + 1,
        worker_id=lease.worker_id,
        queue=lease.queue,
        task=lease.task,
        lease=lease,
        durable=spec is not None and spec.durable,
        **extra,
    )


def park(lease: Lease, ctx: JobContext, wait: Suspend) -> None:
    """Write the park the handler asked for (fenced). A refused park is recorded as a
    fence rejection; a failed write leaves the job to the reaper (lease expiry)."""
    try:
        status = services.suspend(
            lease,
            reason=wait.reason,
            key=wait.key,
            seconds=wait.seconds,
            until=wait.until,
            checkpoint=wait.checkpoint,
        )
    except (DatabaseError, InterfaceError) as exc:
        log.warning("could not park the job (%s); the reaper will recover it", exc,
                    extra=lease.log_fields())  # fmt: skip
        return
    if status is None:
        services.record_fence_rejections([lease], "park")
        return
    log.info("parked: %s", wait.reason.value, extra=lease.log_fields(wait_key=wait.key))


class _RunningWorkflows:
    """Whether any workflow is unfinished, read at most every `every` seconds: a worker
    skips the children query while none is (no cost for deployments without them)."""

    def __init__(self, every: float = 2.0) -> None:
        self.every = every
        self._at = float("-inf")
        self._any = False
        self._lock = threading.Lock()

    def __call__(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self.every:
                self._any = selectors.workflows_running()
                self._at = now
            return self._any


running_workflows = _RunningWorkflows()


def after_ends(job_ids: list[int]) -> None:
    """After a write-back ended `job_ids`: push the workflow children their ends made
    due and observe the workflows they finished (jobs.services.signal_woken_children).
    A failure only delays the children to the next poll."""
    if not job_ids:
        return
    try:
        if running_workflows():
            services.signal_woken_children(job_ids)
    except (DatabaseError, InterfaceError) as exc:
        log.warning("could not signal workflow children (polling finds them): %s", exc)


def observe_steps(lease: Lease, ctx: JobContext) -> None:
    """Steps per job: counted when an attempt that used steps or waits ends (or parks)."""
    names = getattr(ctx, "_names", None)
    if names:
        metrics.child(metrics.STEPS_PER_JOB, lease.task).observe(len(names))
