"""Queue controls: pause, a global concurrency cap, a rate, a polling weight per queue,
fair share between clients and a cap per concurrency key.

The `Queue` rows are the truth; JOBS_QUEUES seeds them (`sync`) and staff edit them
in the admin or with `manage.py queue`. The claim enforces them in PostgreSQL
(`services.claim_limited_under_queue_lock` for a queue with a cap, a rate or a key
cap; `services.claim_fair` for an open fair queue; the open-queue claim refuses any
queue with controls), so the guarantees hold whatever
this module's callers believe. `Gate` is a worker's cached view, which only decides
which claim to make and when a blocked queue is worth asking again.
See docs/queue-controls.md.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from django.db import transaction
from django.db.models.functions import Now

from jobs import queues, selectors, services
from jobs.dispatch import QueueSpec
from jobs.events import backlog
from jobs.events.signing import WEBHOOK_QUEUE
from jobs.models import Queue
from jobs.services import Lease

log = logging.getLogger(__name__)

REFRESH_SECONDS = 1.0  # how stale a worker's view of the controls may get
DEFAULTS: dict[str, Any] = {
    "paused": False,
    "concurrency": None,
    "rate": None,
    "weight": None,
    "fair": False,  # D102: a queue keeps the global claim order unless it says otherwise
    "key_concurrency": None,
    "key_rate": None,
}


class UnknownQueue(LookupError):
    """The queue is not declared in JOBS_QUEUES."""


def _fields(key: str, value: Any) -> dict[str, Any]:
    """A JOBS_QUEUES setting as Queue model fields."""
    if key == "rate":
        limit, period = queues.parse_rate(value) if value is not None else (None, None)
        return {"rate_limit": limit, "rate_period": period}
    if key == "key_rate":
        limit, period = queues.parse_key_rate(value) if value is not None else (None, None)
        return {"key_rate_limit": limit, "key_rate_period": period}
    if key == "weight" and value is not None:
        return {"weight": float(value)}
    return {key: value}


def sync(
    declared: Mapping[str, Mapping[str, Any]] | None = None, *, using: str = "default"
) -> list[str]:
    """Create or update a Queue row per declared queue; returns what changed.

    A setting is written when the row is new or when JOBS_QUEUES changed it since
    the last sync (a key added, removed or given a new value); otherwise the row
    keeps what staff set. So a restart never resumes a queue an operator paused,
    and a deployment that changes a limit gets it (decision D52).
    """
    declared = queues.declared() if declared is None else declared
    changes = []
    objects = Queue.objects.using(using)
    # Not durable: post_migrate runs it too. Rows are inserted and locked in name order,
    # so workers starting together do not deadlock.
    with transaction.atomic(using=using):
        objects.bulk_create([Queue(name=name) for name in sorted(declared)], ignore_conflicts=True)
        rows = {q.name: q for q in objects.select_for_update().filter(name__in=declared)}
        for name, conf in declared.items():
            row = rows[name]
            updates: dict[str, Any] = {}
            for key, default in DEFAULTS.items():
                wanted = conf.get(key, default)
                if row.declared.get(key, default) != wanted:
                    updates.update(_fields(key, wanted))
            if updates or row.declared != dict(conf):
                for field, value in updates.items():
                    setattr(row, field, value)
                row.declared = dict(conf)
                row.updated_at = Now()
                row.save(using=using)
                if updates:
                    changes.append(f"{name}: {', '.join(sorted(updates))}")
    if changes:
        log.info("queue controls synced from JOBS_QUEUES", extra={"changes": changes})
    return changes


def set_paused(name: str, paused: bool, *, durable: bool = True) -> bool:
    """Pause or resume a declared queue; True when its state changed.

    The UPDATE waits for a limited queue's claim in flight (it holds the row's lock),
    so once it commits no claim of a limited queue starts a job; an open queue's
    claim reads the row when its statement begins. `durable=False` inside a caller's
    transaction (the admin writes its audit entry in the same one).
    """
    if not queues.is_declared(name):
        raise UnknownQueue(name)
    with transaction.atomic(durable=durable):
        if not Queue.objects.filter(name=name).exists():  # not synced yet
            sync({name: queues.declared()[name]})
        changed = (
            Queue.objects.filter(name=name)
            .exclude(paused=paused)
            .update(paused=paused, updated_at=Now())
        )
    selectors.forget_paused_queues()  # this process shows the change at once
    return bool(changed)


def _less(start: int | None, claimed: int) -> int | None:
    return None if start is None else max(0, start - claimed)


class Gate:
    """A worker's view of the controls: which queues to skip now, which claim to make.

    The view is at most REFRESH_SECONDS old. A limited queue whose claim its controls
    cut short is `blocked` until its next slot or token may be due and `pending`
    (work known in PostgreSQL whose Redis hints were used up), so that once unblocked
    the worker claims it from PostgreSQL without waiting for a hint.
    """

    def __init__(self) -> None:
        self._controls: dict[str, selectors.QueueControl] = {}
        self._read_at = float("-inf")
        self._blocked: dict[str, float] = {}  # queue -> monotonic time to look again
        self._pending: set[str] = set()
        self._turn_after: dict[str, int] = {}  # fair queue -> client served last
        self._lock = threading.Lock()  # the flusher frees slots from its thread

    def _refresh(self) -> None:
        if time.monotonic() - self._read_at >= REFRESH_SECONDS:
            self._controls = selectors.queue_controls()
            self._read_at = time.monotonic()

    def weights(self) -> dict[str, float]:
        """The Queue model's weights (those set), for QueueSpec.with_queues."""
        self._refresh()
        return {q: c.weight for q, c in self._controls.items() if c.weight is not None}

    def open(self, order: list[str]) -> list[str]:
        """`order` without the queues paused or blocked now."""
        self._refresh()
        # The outbox first (D409); asked outside the lock: it may ask Redis.
        held = WEBHOOK_QUEUE in order and backlog.HOLD.on()
        now = time.monotonic()
        with self._lock:
            if held:
                self._blocked[WEBHOOK_QUEUE] = now + backlog.LOOK_SECONDS
            for queue, until in list(self._blocked.items()):
                if until <= now:
                    del self._blocked[queue]
            blocked = set(self._blocked)
        out = []
        for queue in order:
            control = self._controls.get(queue)
            if queue in blocked or (control is not None and control.paused):
                continue
            out.append(queue)
        return out

    def wake_in(self, longest: float | None = None) -> float | None:
        """Seconds until the first blocked queue may be claimed again (at most
        `longest`); `longest` (or None) when none is blocked."""
        with self._lock:
            first = min(self._blocked.values(), default=None)
        if first is None:
            return longest
        wait = max(0.0, first - time.monotonic())
        return wait if longest is None else min(wait, longest)

    def freed(self, queues_: Iterable[str]) -> None:
        """This worker wrote back jobs of these queues: a capped one has a slot now."""
        with self._lock:
            for queue in queues_:
                control = self._controls.get(queue)
                if control is not None and (
                    control.concurrency is not None
                    or control.key_concurrency is not None
                    or control.key_rate_limit is not None
                ):
                    self._blocked.pop(queue, None)

    def held_back(self, queue: str) -> bool:
        """The queue's last claim was cut short by its controls (its jobs wait for it)."""
        return queue in self._pending

    def claim_pending(
        self, worker_id: str, order: list[str], limit: int, *, start: int | None = None
    ) -> list[Lease]:
        """Claim from the open queues of `order` known to hold work the controls held back."""
        pending = [q for q in order if q in self._pending]
        return self.claim_next(worker_id, pending, limit, start=start) if pending else []

    def polling_order(self, spec: QueueSpec, found: Iterable[str] = ()) -> list[str]:
        """The queues of `spec` (and `found`, for `*`) in a weighted random order, a
        weight the spec does not give taken from the controls; paused or blocked ones
        left out."""
        return self.open(spec.polling_order(found, self.weights()))

    def first_look(
        self,
        worker_id: str,
        spec: QueueSpec,
        found: Iterable[str],
        limit: int,
        *,
        start: int | None = None,
    ) -> tuple[list[Lease], list[str], float | None]:
        """A worker's first ask of a discovery, in one call: its open queues in polling
        order (polling_order), the work the controls held back claimed from them
        (claim_pending), the queues open after that claim (less any it found blocked
        again), and the seconds until a blocked queue may be claimed again (wake_in)."""
        order = self.polling_order(spec, found)
        leases = self.claim_pending(worker_id, order, limit, start=start)
        return leases, order if leases else self.open(order), self.wake_in()

    def claim_next(
        self, worker_id: str, order: Iterable[str], limit: int, *, start: int | None = None
    ) -> list[Lease]:
        """Like services.claim_next, with a limited queue claimed under its lock and a
        fair one in turns, from the client after the one this worker served last; the
        first `start` claimed (all when None) are marked started (D77)."""
        leases: list[Lease] = []
        for queue in order:
            if len(leases) >= limit:
                break
            control = self._controls.get(queue)
            after = self._turn_after.get(queue, 0)
            if control is not None and control.fair and not control.limited:
                turns = services.claim_fair(
                    worker_id, queue, limit - len(leases), after, start=_less(start, len(leases))
                )
                self._turn_after[queue] = turns.last_client
                leases += turns.leases
                continue
            if control is None or not control.limited:
                leases += services.claim_next(
                    worker_id, [queue], limit - len(leases), start=_less(start, len(leases))
                )
                continue
            got = services.claim_limited_under_queue_lock(
                worker_id, queue, limit - len(leases), after, start=_less(start, len(leases))
            )
            self._turn_after[queue] = got.last_client
            leases += got.leases
            with self._lock:
                if got.blocked_for is None:
                    self._pending.discard(queue)
                else:
                    wait = got.blocked_for if math.isfinite(got.blocked_for) else REFRESH_SECONDS
                    self._blocked[queue] = time.monotonic() + min(wait, REFRESH_SECONDS)
                    self._pending.add(queue)
        return leases
