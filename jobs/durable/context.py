"""The handler context of every job (DurableContext) and the worker's side of its
waits: the park or continue-as-new the handler asked for, written under the fence."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import DatabaseError, InterfaceError

from jobs import metrics, selectors, services, tasks
from jobs.durable.chain import Chain
from jobs.durable.errors import ContinueAsNew, Suspend
from jobs.durable.history import Replay
from jobs.durable.waits import Waits
from jobs.lifecycle import WaitReason
from jobs.services import Lease
from jobs.tasks import JobContext

log = logging.getLogger(__name__)


@dataclass
class DurableContext(Replay, Waits, Chain, JobContext):
    """The handler context of every job: JobContext plus steps and their replay
    (jobs.durable.history), waits (jobs.durable.waits), continue-as-new
    (jobs.durable.chain) and, for a workflow job, its parents' results. Loads nothing
    until one is used. `check_replay = False` turns the replay order check off."""

    lease: Lease | None = field(default=None, repr=False, compare=False)
    durable: bool = field(default=False, repr=False, compare=False)
    check_replay: bool = field(default=True, repr=False, compare=False)
    _steps: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    _order: list[str] = field(default_factory=list, repr=False, compare=False)
    _cursor: int = field(default=0, repr=False, compare=False)
    _loaded_at: datetime | None = field(default=None, repr=False, compare=False)
    _names: set[str] | None = field(default=None, repr=False, compare=False)
    _sleeps: int = field(default=0, repr=False, compare=False)
    _parents: tuple[dict, dict] | None = field(default=None, repr=False, compare=False)

    # --- workflows ----------------------------------------------------------------------

    def _read_parents(self) -> tuple[dict, dict]:
        return selectors.parent_outcomes(self.job_id)

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


def _continue(lease: Lease, wait: ContinueAsNew) -> None:
    next_id = services.continue_as_new(lease, wait.payload_json)
    if next_id is not None:
        log.info("continued as new: run %s", next_id, extra=lease.log_fields(next_run_id=next_id))
        return
    # Refused: a stale lease (the park below is refused too and recorded), or a cancel
    # pending, which the park turns into the cancelled end it owes.
    park(lease, None, Suspend(WaitReason.SLEEP, seconds=0.0))


def park(lease: Lease, ctx: JobContext | None, wait: Suspend) -> None:
    """Write the park (or the continue-as-new) the handler asked for, fenced. A refused
    park is recorded as a fence rejection; a failed write leaves the job to the reaper
    (lease expiry)."""
    try:
        if isinstance(wait, ContinueAsNew):
            _continue(lease, wait)
            return
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


def observe_steps(lease: Lease, ctx: JobContext) -> None:
    """Steps per job and the run's history size: observed when an attempt that used
    steps or waits ends (or parks)."""
    names = getattr(ctx, "_names", None)
    if names:
        metrics.child(metrics.STEPS_PER_JOB, lease.task).observe(len(names))
        order = getattr(ctx, "_order", None)
        metrics.child(metrics.HISTORY_STEPS, lease.task).observe(len(order or names))
