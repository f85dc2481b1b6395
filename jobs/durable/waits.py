"""Waits that do not hold a worker: durable sleeps and signal waits park the job; the
handler replays from the top when it runs again and the history says where it stopped
(checkpoints named "~sleep:N", "~wait:KEY", "~signal:KEY")."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from jobs import selectors
from jobs.durable.errors import MAX_STEP_NAME, WAIT_PREFIX, SignalTimeout, StepError, Suspend
from jobs.lifecycle import BLOCKED_RUN_AT, WaitReason
from jobs.tasks import JobContext


class Waits:
    """sleep and wait_for_signal, mixed into DurableContext after Replay (whose cursor
    and checkpoints they use)."""

    def _read_signal(self, key: str) -> tuple[bool, Any]:
        return selectors.job_signal(self.job_id, key)

    def _deadline(self, name: str) -> tuple[bool, Any]:
        """(parked before, its deadline or None) for a wait checkpoint."""
        if not self._take(name):
            return False, None
        until = (self._steps[name] or {}).get("until")
        return True, (datetime.fromisoformat(until) if until else None)

    def sleep(self, seconds: float) -> bool:
        """In a durable task: park the job for `seconds` without holding the worker and
        return True when it runs again. Elsewhere: JobContext's cooperative sleep."""
        if not self.durable:
            return JobContext.sleep(self, seconds)
        self._sleeps += 1
        name = f"{WAIT_PREFIX}sleep:{self._sleeps}"
        self._claim_name(name)
        parked, until = self._deadline(name)
        if not parked:
            self._fresh(name)
            raise Suspend(WaitReason.SLEEP, seconds=max(0.0, float(seconds)), checkpoint=name)
        if until is not None and until <= self._loaded_at:
            return True
        raise Suspend(WaitReason.SLEEP, until=until)

    def wait_for_signal(self, key: str, timeout: float | None = None) -> Any:
        """Park until a signal `key` arrives (or use one that arrived before) and return
        its payload; raise SignalTimeout after `timeout` seconds without one. Prefer a
        timeout: a wait without one on an old run is flagged (D319)."""
        if not isinstance(key, str) or not key or len(key) > MAX_STEP_NAME - 10:
            raise StepError(f"a signal key is 1-{MAX_STEP_NAME - 10} characters, not {key!r}")
        got = f"{WAIT_PREFIX}signal:{key}"
        wait = f"{WAIT_PREFIX}wait:{key}"
        self._claim_name(got)
        parked, until = self._deadline(wait)
        if self._take(got):
            stored = self._steps[got]
            if stored.get("timed_out"):
                raise SignalTimeout(key, stored.get("timeout"))
            return stored.get("payload")
        self._fresh(got)
        found, payload = self._read_signal(key)
        if found:
            return self._checkpoint(got, {"payload": payload})["payload"]
        if parked and until is not None and until <= self._loaded_at:
            self._checkpoint(got, {"timed_out": True, "timeout": timeout})
            raise SignalTimeout(key, timeout)
        if parked:
            raise Suspend(WaitReason.SIGNAL, key=key, until=until or BLOCKED_RUN_AT)
        if timeout is None:
            raise Suspend(WaitReason.SIGNAL, key=key, until=BLOCKED_RUN_AT, checkpoint=wait)
        raise Suspend(WaitReason.SIGNAL, key=key, seconds=max(0.0, float(timeout)), checkpoint=wait)
