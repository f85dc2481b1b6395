"""What a failed attempt leaves behind: storable error text, class and traceback.

PostgreSQL text cannot hold NUL, and UTF-8 cannot hold a lone surrogate (what
`bytes.decode(..., "surrogateescape")` leaves in a str). Error text from a
handler may contain both, so every piece is made storable here, in the
handler's thread, before it joins a batched write-back: it is escaped, never
dropped.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import dataclass

MAX_ERROR_CHARS = 4000
# A traceback keeps its last 30 frames and at most its last 8 KiB of text: the
# frames nearest the failure are the ones that locate it.
TRACEBACK_FRAMES = 30
TRACEBACK_CHARS = 8192
TRUNCATED = "…(traceback truncated)\n"


def storable(text: str) -> str:
    """`text` with NUL and lone surrogates escaped (`\\x00`, `\\udce9`)."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as inner:  # a broken __str__ must not lose the failure
        return f"<str() raised {inner.__class__.__name__}>"


def describe(exc: BaseException) -> str:
    """The error text stored on the job: "Class: message", storable and bounded."""
    return storable(f"{exc.__class__.__name__}: {_message(exc)}")[:MAX_ERROR_CHARS]


def class_path(exc: BaseException) -> str:
    """Import path of the exception's class, e.g. `builtins.ValueError`."""
    cls = exc.__class__
    return storable(f"{cls.__module__}.{cls.__qualname__}")[:200]


def format_traceback(exc: BaseException, skip_from: str | None = None) -> str:
    """The last TRACEBACK_FRAMES frames, cut to the last TRACEBACK_CHARS characters.

    Leading frames from the file `skip_from` (the worker that called the handler; a
    directory ending in a separator: any file in it) are left out: the traceback
    starts where the task's own code does.
    """
    try:
        tb = exc.__traceback__
        while skip_from and tb is not None and tb.tb_frame.f_code.co_filename.startswith(skip_from):
            tb = tb.tb_next
        text = "".join(
            traceback.format_exception(
                type(exc), exc, tb or exc.__traceback__, limit=-TRACEBACK_FRAMES
            )
        )
    except Exception:  # formatting must never cost the failure itself
        text = describe(exc)
    text = storable(text)
    if len(text) > TRACEBACK_CHARS:
        text = TRUNCATED + text[-(TRACEBACK_CHARS - len(TRUNCATED)) :]
    return text


@dataclass(frozen=True, slots=True)
class AttemptError:
    """A failed attempt as written back: message, exception class and traceback."""

    message: str
    error_class: str | None = None
    traceback: str | None = None

    @classmethod
    def of(
        cls, exc: BaseException, message: str | None = None, skip_from: str | None = None
    ) -> AttemptError:
        return cls(
            storable(message)[:MAX_ERROR_CHARS] if message is not None else describe(exc),
            class_path(exc),
            format_traceback(exc, skip_from),
        )


class PerKeyRateLimit:
    """A token bucket per key: `burst` events at once, then one per `every` seconds.

    Used to log tracebacks of failed attempts per task, so that one task failing
    in a flood does not drown the logs (or the others' tracebacks).
    """

    def __init__(self, burst: int = 5, every: float = 12.0) -> None:
        self.burst = burst
        self.every = every
        self._buckets: dict[str, tuple[float, float]] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def allow(self, key: str) -> tuple[bool, int]:
        """(allowed, events suppressed since the last allowed one)."""
        now = time.monotonic()
        with self._lock:
            tokens, stamp = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - stamp) / self.every)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return True, self._suppressed.pop(key, 0)
            self._buckets[key] = (tokens, now)
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False, 0


def log_failed_attempt(
    log: logging.Logger,
    limiter: PerKeyRateLimit,
    task: str,
    exc: BaseException,
    error: str,
    extra: dict,
) -> None:
    """WARNING with the traceback while the task is within its rate, one INFO line after."""
    allowed, suppressed = limiter.allow(task)
    if allowed:
        more = f" ({suppressed} earlier failure(s) of this task logged without traceback)"
        log.warning(
            "attempt failed: %s%s",
            error,
            more if suppressed else "",
            exc_info=(type(exc), exc, exc.__traceback__),
            extra=extra,
        )
    else:
        log.info("attempt failed: %s", error, extra=extra)
