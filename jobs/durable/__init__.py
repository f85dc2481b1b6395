"""Durable jobs: step checkpoints and waits that do not hold a worker (issue 17), runs
that continue as new and replays checked against their history (issue 45).

A handler's `ctx.step(name, fn, ...)` runs `fn` at most once per run across
attempts once its checkpoint committed: the result is written under the job's
fence (jobs.services.checkpoint_step), and a later attempt gets it back without
calling `fn`. A step whose function ran but whose checkpoint did not commit (a
crash, a lost lease) runs again: at-least-once per step, exactly-once per
committed step. A stale worker's checkpoint is refused like its completion; the
attempt then ends without writing anything else.

`ctx.sleep(s)` (in tasks registered `durable=True`) and `ctx.wait_for_signal(key)`
park the job: the attempt ends, the job goes back to queued with a future run_at
and a lease bump, no retry spent, and the handler replays from the top when it
runs again (completed steps return at once, in the order the history holds them).
Waits are checkpoints too (names starting with "~"), so a replay knows where it
stopped. `ctx.continue_as_new(payload)` ends the run and starts the next with an
empty history.

The parts: errors (what handlers raise), history (steps, replay, patches), waits,
chain (continue-as-new), context (DurableContext and the worker's park), hooks (the
worker's after-end calls).
"""

from jobs.durable.chain import SAME_PAYLOAD
from jobs.durable.context import DurableContext, context, observe_steps, park
from jobs.durable.errors import (
    MAX_STEP_NAME,
    WAIT_PREFIX,
    ContinueAsNew,
    FencedOff,
    NondeterministicReplay,
    SignalTimeout,
    StepError,
    Suspend,
    max_steps,
)
from jobs.durable.hooks import after_ends, running_workflows

__all__ = [
    "MAX_STEP_NAME",
    "SAME_PAYLOAD",
    "WAIT_PREFIX",
    "ContinueAsNew",
    "DurableContext",
    "FencedOff",
    "NondeterministicReplay",
    "SignalTimeout",
    "StepError",
    "Suspend",
    "after_ends",
    "context",
    "max_steps",
    "observe_steps",
    "park",
    "running_workflows",
]
