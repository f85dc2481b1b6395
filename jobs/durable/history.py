"""A run's history and its replay: stored checkpoints read in one query, in commit
order, and the order check that refuses to mix them with code that asks for other
steps (D317). `Replay.step` and `Replay._stored` are the entry points a tracer wraps."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.db import DataError, connection

from jobs import metrics, selectors, services
from jobs.durable.errors import (
    MAX_STEP_NAME,
    WAIT_PREFIX,
    FencedOff,
    NondeterministicReplay,
    StepError,
    max_steps,
    to_json,
)
from jobs.observability import hooks as spans

PATCH_PREFIX = f"{WAIT_PREFIX}patch:"


class Replay:
    """Steps, patch markers and the history cursor, mixed into DurableContext (whose
    dataclass fields `_steps`, `_order`, `_cursor`, `_names` and `_loaded_at` they use).

    The history is the run's checkpoints in commit order. Each step or wait the code
    asks for takes the history's next entry; asking for anything else before the end
    of the history is a NondeterministicReplay (unless `check_replay` is False)."""

    def _stored(self) -> dict[str, Any]:
        if self._steps is None:
            if self.lease is not None and self.lease.lease_version == 1:
                # The run's first lease: no attempt before it could checkpoint (every
                # checkpoint is fenced by its lease), so there is nothing to read (D320).
                self._steps, self._loaded_at = {}, None
            else:
                self._steps, self._loaded_at = self._read_steps()
            self._order = list(self._steps)
        return self._steps

    # The database work, in methods a process-pool child overrides to ask its parent
    # instead (jobs.worker.pools.child).

    def _read_steps(self) -> tuple[dict[str, Any], datetime | None]:
        return selectors.job_steps(self.job_id)

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
                f"step limit reached: a run may have at most {max_steps()} steps "
                "(JOBS_MAX_STEPS); continue as new (ctx.continue_as_new) or split the "
                "work into a workflow"
            )
        self._names.add(name)

    # --- the cursor ------------------------------------------------------------------

    def _take(self, name: str) -> bool:
        """Whether the history holds `name` at this point (taken); a stored entry out
        of its place is a nondeterministic replay."""
        stored = self._stored()
        order = self._order
        if self._cursor < len(order) and order[self._cursor] == name:
            self._cursor += 1
            return True
        if name in stored:
            if self.check_replay:
                self._nondeterministic(name)
            return True
        return False

    def _fresh(self, name: str) -> None:
        """`name` is new to the history: right at its end, wrong before it."""
        if self.check_replay and self._cursor < len(self._order):
            self._nondeterministic(name)

    def _nondeterministic(self, asked: str) -> None:
        metrics.child(metrics.NONDETERMINISTIC, self.task).inc()
        at = self._cursor
        stored = self._order[at] if at < len(self._order) else "(its end)"
        raise NondeterministicReplay(at, stored, asked)

    def _checkpoint(self, name: str, value: Any) -> Any:
        if connection.in_atomic_block:
            # Inside a transaction the checkpoint (and a refusal's record) would commit
            # or roll back with it, not alone: a step would not be a step.
            raise StepError(f"step {name!r} inside a transaction: a checkpoint commits alone")
        text = to_json(name, value)
        try:
            held = self._write_checkpoint(name, text)
        except DataError as exc:
            raise StepError(f"step {name!r} result refused by PostgreSQL: {exc}") from None
        if not held:
            self.lost_authority = True
            self.stop.set()
            raise FencedOff(name)
        self._stored()[name] = json.loads(text)
        self._order.append(name)
        self._cursor = len(self._order)
        return self._steps[name]  # type: ignore[index]

    # --- the handler's API ----------------------------------------------------------

    def step(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` once per run: its JSON result is checkpointed under
        the job's fence and returned (as stored) on every later attempt without
        calling `fn`. Names are unique within a run and may not start with "~"."""
        if not isinstance(name, str) or not name or len(name) > MAX_STEP_NAME:
            raise StepError(f"a step name is 1-{MAX_STEP_NAME} characters, not {name!r}")
        if name.startswith(WAIT_PREFIX):
            raise StepError(f"step names starting with {WAIT_PREFIX!r} are reserved: {name!r}")
        self._claim_name(name)
        if self._take(name):
            return self._steps[name]  # type: ignore[index]
        self._fresh(name)
        with spans.step(name):  # the step's span (jobs.observability)
            return self._checkpoint(name, fn(*args, **kwargs))

    def patched(self, change_id: str) -> bool:
        """Whether this run takes the new branch of a change (Temporal's pattern): True
        for a run that reaches this point after the change was deployed (a marker is
        stored), False for one whose history had already passed it (D318)."""
        if not isinstance(change_id, str) or not change_id or len(change_id) > 150:
            raise StepError(f"a change id is 1-150 characters, not {change_id!r}")
        name = f"{PATCH_PREFIX}{change_id}"
        if self._names is not None and name in self._names:
            return name in self._stored()
        self._claim_name(name)
        if self._take(name):
            return True
        if self._cursor < len(self._order):
            return False
        self._checkpoint(name, True)
        return True

    @property
    def history_size(self) -> int:
        """History rows of the run loaded so far (0 before a step or wait)."""
        return len(self._order)
