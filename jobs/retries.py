"""A task's own retry policy: which exceptions retry, which give up, and the backoff.

    @task("fetch-feed", retry_on=(TimeoutError,), backoff=(2.0, 60.0, 0.1))
    def fetch(payload, ctx): ...

Checked when the decorator runs (at import), so a wrong policy stops the process that
loads it instead of the first job that fails. Without a policy nothing changes: every
exception retries with the global backoff (JOBS_RETRY_BACKOFF_BASE/MAX, in SQL).
The worker records each decision in the job's history (`retry_policy` events).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class PermanentError(Exception):
    """Raised by a handler: the job fails at once, no retries (SPEC §4)."""


class RetryableError(Exception):
    """Raised by a handler to ask for a retry explicitly (any other exception retries too).
    `retry_after` (seconds) holds the retry back at least that long (e.g. a receiver's
    Retry-After); the usual backoff still applies when it is longer."""

    def __init__(self, *args: Any, retry_after: float | None = None) -> None:
        super().__init__(*args)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Decision:
    give_up: bool
    delay: float | None  # seconds before the retry (None when giving up)
    reason: str  # what the history says


def _exception_classes(value: object, name: str) -> tuple[type[BaseException], ...]:
    if isinstance(value, type):
        value = (value,)
    if not isinstance(value, tuple | list) or not all(
        isinstance(c, type) and issubclass(c, BaseException) for c in value
    ):
        raise TypeError(f"{name} must be a tuple of exception classes, not {value!r}")
    return tuple(value)


def _seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"backoff {name} must be a number >= 0, not {value!r}")
    if value == float("inf"):
        raise ValueError(f"backoff {name} must be finite")
    return float(value)


@dataclass(frozen=True)
class RetryPolicy:
    retry_on: tuple[type[BaseException], ...] | None = None  # None: every exception
    give_up_on: tuple[type[BaseException], ...] = ()
    backoff: Callable[[int], float] | tuple[float, float, float] | None = None

    @classmethod
    def build(
        cls,
        retry_on: object = None,
        give_up_on: object = None,
        backoff: object = None,
    ) -> RetryPolicy | None:
        """The policy, or None when nothing was asked (the defaults apply); raises
        TypeError/ValueError for a policy that cannot work."""
        if retry_on is None and give_up_on is None and backoff is None:
            return None
        on = None if retry_on is None else _exception_classes(retry_on, "retry_on")
        off = () if give_up_on is None else _exception_classes(give_up_on, "give_up_on")
        if backoff is not None and not callable(backoff):
            if not isinstance(backoff, tuple | list) or len(backoff) != 3:
                raise TypeError(
                    f"backoff must be a callable(retry) or (base, max, jitter), not {backoff!r}"
                )
            names = ("base", "max", "jitter")
            base, cap, jitter = (_seconds(v, n) for v, n in zip(backoff, names, strict=True))
            if cap < base:
                raise ValueError(f"backoff max ({cap:g}) must be >= base ({base:g})")
            if jitter > 1:
                raise ValueError(f"backoff jitter must be between 0 and 1, not {jitter:g}")
            backoff = (base, cap, jitter)
        return cls(on, off, backoff)

    def decide(self, exc: BaseException, retry: int) -> Decision:
        """What to do with `exc` raised by the attempt before retry number `retry`
        (1: the first retry). A PermanentError never reaches here; the retry budget
        (max_retries) still applies after a retry is chosen."""
        name = type(exc).__name__
        if isinstance(exc, self.give_up_on):
            return Decision(True, None, f"no retry: {name} is in give_up_on")
        if self.retry_on is not None and not isinstance(exc, (*self.retry_on, RetryableError)):
            return Decision(True, None, f"no retry: {name} is not in retry_on")
        delay, how = self.delay(retry)
        why = "retry_on" if self.retry_on is not None else "any exception retries"
        if self.retry_on is not None and isinstance(exc, RetryableError):
            why = "RetryableError"
        return Decision(False, delay, f"retry {retry} in {delay:.3f}s ({name}: {why}; {how})")

    def delay(self, retry: int) -> tuple[float, str]:
        """Seconds before retry number `retry`, and how they were chosen."""
        backoff = self.backoff
        if backoff is None:
            from jobs.conf import settings

            backoff = (
                float(settings.JOBS_RETRY_BACKOFF_BASE),
                float(settings.JOBS_RETRY_BACKOFF_MAX),
                0.5,
            )
        if callable(backoff):
            seconds = float(backoff(retry))
            if not seconds >= 0 or seconds == float("inf"):
                raise ValueError(f"backoff({retry}) returned {seconds!r}, not seconds >= 0")
            return seconds, f"backoff({retry})"
        base, cap, jitter = backoff
        full = min(cap, base * 2 ** (retry - 1))
        seconds = full * (1 - jitter * random.random())
        return seconds, f"min({cap:g}, {base:g}×2^{retry - 1}) = {full:g}s, jitter {jitter:g}"
