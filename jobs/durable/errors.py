"""What durable handlers raise and what the worker catches: the attempt-ending signals
(Suspend, ContinueAsNew, FencedOff) and the errors that fail a job at once."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jobs.conf import settings
from jobs.lifecycle import WaitReason
from jobs.tasks import PermanentError

WAIT_PREFIX = "~"  # checkpoints of the job's own waits; user step names may not start so
MAX_STEP_NAME = 200


def max_steps() -> int:
    return int(settings.JOBS_MAX_STEPS)


class StepError(PermanentError):
    """A step the job cannot go on with (bad name, too many, unstorable result): the
    job fails at once; running it again would fail the same way."""


class NondeterministicReplay(StepError):
    """The handler's code asked for another step than the one its history holds at
    that point (a renamed, added or reordered step under a parked job): mixing stored
    results with other code would be silently wrong, so the job fails (D317)."""

    def __init__(self, position: int, stored: str, asked: str) -> None:
        super().__init__(
            f"nondeterministic replay: history entry #{position + 1} is {stored!r}, "
            f"the code asked for {asked!r}; use ctx.patched() for a change under a "
            "parked job (docs/durable.md)"
        )
        self.position, self.stored, self.asked = position, stored, asked


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


class ContinueAsNew(Suspend):
    """Raised by `ctx.continue_as_new()`: the attempt ends, the run ends done and its
    next run starts with an empty history (jobs.services.continue_as_new)."""

    def __init__(self, payload_json: str | None) -> None:
        super().__init__(WaitReason.SLEEP, seconds=0.0)
        self.payload_json = payload_json


class FencedOff(BaseException):
    """A checkpoint the fence refused: this worker lost the job; the attempt ends."""


def to_json(name: str, value: Any) -> str:
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
