"""Deliveries wait while the outbox is far behind: upstream first (issue 41, D409).

A drain writes history faster than the reaper's relays pass it, and the deliveries the
fan-out releases meanwhile run on the same cores: a delivery is a job (its claim, its
call, its completion, and three history rows every relay passes again), about 1.2 ms of
CPU across the processes. Side by side, deliveries started only once every cursor had
passed (`python -m bench --scenario drain-sinks --deliveries-after-sinks`) halved every
sink's lag after a drain, and the receiver's last delivery came about when it did: the
same work in a better order. So a reaper whose fan-out or stream is a full batch or more behind
says so (a Redis key with a short life), and workers leave the webhooks queue unclaimed
while it is set: for at most JOBS_WEBHOOK_OUTBOX_HOLD seconds in a row, then as long
again open, so deliveries never wait on a backlog that does not end. Without Redis, or
with the setting at 0, nothing waits. Kafka's relay does not hold deliveries: a slow
broker is not the cores' work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from jobs import metrics
from jobs.conf import settings
from jobs.transport import TransportError, get_transport

log = logging.getLogger(__name__)

FLAG = "outbox:behind"
# A reaper that stops saying it is behind (stopped, killed) holds nobody past this.
FLAG_MS = 2000
# How often a reaper that is still behind says so again.
REFRESH_SECONDS = FLAG_MS / 1000 / 4
# How often a worker looks (the gate's wait while held).
LOOK_SECONDS = 0.05


class Backlog:
    """A reaper's side: each of its relays reports how far behind its tick left it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._behind: dict[str, bool] = {}
        self._said_at: float | None = None  # when the flag was last set; None: cleared

    def report(self, name: str, waiting: int, batch: int) -> None:
        """`waiting`: ids behind the horizon after the relay `name`'s tick; a full batch
        or more is behind."""
        with self._lock:
            self._behind[name] = waiting >= batch
            behind = any(self._behind.values())
            now = time.monotonic()
            if behind and self._said_at is not None and now - self._said_at < REFRESH_SECONDS:
                return
            if not behind and self._said_at is None:
                return
            self._said_at = now if behind else None
        try:
            if behind:
                get_transport().set_flag(FLAG, FLAG_MS)
            else:
                get_transport().clear_flag(FLAG)
        except TransportError as exc:  # the flag lapses by itself; deliveries go on
            log.debug("outbox backlog flag not written: %s", exc)


class Hold:
    """A worker's side: whether its deliveries wait now, looked up at most every
    LOOK_SECONDS, and never more than JOBS_WEBHOOK_OUTBOX_HOLD seconds in a row."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._looked_at = float("-inf")
        self._set = False
        self._since: float | None = None  # when this run of holds began

    def on(self) -> bool:
        limit = settings.JOBS_WEBHOOK_OUTBOX_HOLD
        transport = get_transport()
        if limit <= 0 or not transport.enabled:
            return False
        with self._lock:
            now = self._clock()
            if now - self._looked_at >= LOOK_SECONDS:
                self._looked_at = now
                try:
                    self._set = transport.flag(FLAG)
                except TransportError:
                    self._set = False  # Redis away: nobody can say the outbox is behind
            if not self._set:
                self._since = None
                return False
            if self._since is None:
                self._since = now
                metrics.WEBHOOK_OUTBOX_HOLDS.inc()
            # Held for `limit`, then open for as long, while the backlog lasts.
            return (now - self._since) % (2 * limit) < limit


HOLD = Hold()
