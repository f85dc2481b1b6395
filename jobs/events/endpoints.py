"""An endpoint's slots as this process holds them, each with a kept-alive connection.

The bound (JOBS_WEBHOOK_ENDPOINT_CONCURRENCY calls at once per endpoint, across every
process) is still a PostgreSQL session advisory lock per slot. What changes (issue 41)
is who holds it: a slot is held by the process, on a session of its own, for as long as
its delivery threads keep it busy, not taken and given back by each attempt on the
thread's session. A delivery that finds its endpoint's slots busy *in this process*
waits for one (a fast endpoint frees one within milliseconds) instead of parking for a
second; it parks as before when the wait would be long (a slow endpoint: it holds no
thread) or when other processes hold every slot. A slot free for LINGER_SECONDS is given
back, so an idle process holds none; a killed process's slots free themselves with
its sessions.

Each slot keeps its HTTP connections (one per address it was sent to, the address
ssrf.check gave): consecutive deliveries to a fast receiver reuse the TCP (and TLS)
connection. Each attempt's Deadline still shuts the connection down when its time is
spent (jobs.events.deadline), a reused connection included.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from jobs.conf import settings
from jobs.events import exchange

log = logging.getLogger(__name__)

# Advisory lock namespace of endpoint slots ('whk' + slot number in the low byte); the
# second key is the webhook id. Distinct from the worker sessions' space ('jobs').
ENDPOINT_LOCK_SPACE = 0x77686B00
MAX_ENDPOINT_CONCURRENCY = 255
# A delivery waits for a slot its process holds when the wait it expects (the
# endpoint's recent call time × the deliveries ahead of it) is at most this; longer, it
# parks. So a slow endpoint's deliveries hold no thread, a fast one's never park.
WAIT_LIMIT = 0.25
# How long a run of an endpoint's deliveries goes on, at most, once a delivery of its
# process waits for its slot (jobs.events.batches).
RUN_HANDOVER = 0.25
# A slot nobody here used for this long goes back (its advisory lock released).
LINGER_SECONDS = 0.2
# Lock sessions kept open for the next slot taken (each costs a connect otherwise).
SPARE_SESSIONS = 4

# Delivery workers alive now: an endpoint's slots are shared out between them.
_DELIVERY_WORKERS_SQL = """
SELECT count(*) FROM jobs_worker
WHERE %s = ANY(queues) AND heartbeat_at > now() - %s * interval '1 second'
"""
SHARE_REFRESH_SECONDS = 5.0
_TAKE_SQL = "SELECT pg_try_advisory_lock(%s, (%s::bigint %% 2147483648)::int)"
_GIVE_SQL = "SELECT pg_advisory_unlock(%s, (%s::bigint %% 2147483648)::int)"


@dataclass(eq=False)
class Slot:
    """One of an endpoint's slots, held by this process (`session` holds its lock;
    None: endpoints are not bounded)."""

    webhook_id: int
    number: int
    session: psycopg.Connection | None
    connections: dict[tuple, exchange.Connection] = field(default_factory=dict)
    freed_at: float = 0.0

    def connection(self, scheme: str, address: str, port: int, host: str) -> exchange.Connection:
        """The kept-alive connection to `address` (checked by ssrf) for `host`'s URL."""
        key = (scheme, address, port, host, settings.JOBS_WEBHOOK_CA_BUNDLE)
        kept = self.connections.get(key)
        if kept is None:
            if len(self.connections) >= 4:  # a name that resolves elsewhere now: drop the old
                self.close_connections()
            kept = exchange.Connection(scheme, address, port, host,
                                       settings.JOBS_WEBHOOK_CA_BUNDLE or None)  # fmt: skip
            self.connections[key] = kept
        return kept

    def close_connections(self) -> None:
        for kept in self.connections.values():
            kept.close()
        self.connections.clear()


@dataclass(eq=False)
class Taken:
    """One use of a slot: given back once, however many times `give` is called (a
    slot given back may already be another thread's)."""

    slot: Slot
    slots: Slots
    given: bool = False

    seconds: float | None = None

    def note(self, seconds: float) -> None:
        """A call took `seconds`: counted when the slot goes back."""
        self.seconds = seconds

    def give(self, seconds: float | None = None) -> None:
        """Back after a call that took `seconds` (None: no call, or the one noted)."""
        if not self.given:
            self.given = True
            self.slots._give(self.slot, self.seconds if seconds is None else seconds)


@dataclass(eq=False)
class Lent:
    """A delivery's call handed to the run that holds its endpoint's slot in this
    process: made on the run's slot, its answer (or error) handed back (D261)."""

    call: Callable[[Slot], Any]
    done: threading.Event = field(default_factory=threading.Event)
    called: bool = False
    answer: Any = None
    error: BaseException | None = None
    seconds: float = 0.0


@dataclass(eq=False)
class _Endpoint:
    lent: list[Lent] = field(default_factory=list)
    held: list[Slot] = field(default_factory=list)
    free: list[Slot] = field(default_factory=list)
    taking: int = 0  # threads trying for one more slot in the database now
    waiters: int = 0
    call_seconds: float = 0.0  # moving average of a call's duration here
    runs: int = 0  # runs of its due deliveries going on here (jobs.events.batches)


class Slots:
    """This process's endpoint slots. `take` → Taken or None (park); its `give` after
    the call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._endpoints: dict[int, _Endpoint] = {}
        self._spare: list[psycopg.Connection] = []
        self._linger: threading.Thread | None = None
        self._workers = 1  # delivery worker processes alive (SHARE_REFRESH_SECONDS old)
        self._workers_at = -SHARE_REFRESH_SECONDS

    @staticmethod
    def limit() -> int:
        return min(settings.JOBS_WEBHOOK_ENDPOINT_CONCURRENCY, MAX_ENDPOINT_CONCURRENCY)

    def take(self, webhook_id: int) -> Taken | None:
        """A slot of the endpoint for one call, or None when every slot is busy for
        longer than WAIT_LIMIT (held by other processes, or by slow calls here)."""
        limit = self.limit()
        if limit <= 0:
            return Taken(Slot(webhook_id, -1, None), self)
        until = time.monotonic() + WAIT_LIMIT
        with self._lock:
            endpoint = self._endpoints.setdefault(webhook_id, _Endpoint())
        while True:
            with self._lock:
                if endpoint.free:
                    return self._use(endpoint.free.pop())
                mine = {s.number for s in endpoint.held}
                more = len(mine) + endpoint.taking < limit
                if more:
                    endpoint.taking += 1
            if more:
                slot = None
                try:
                    slot = self._lock_one(webhook_id, [n for n in range(limit) if n not in mine])
                finally:
                    with self._lock:
                        endpoint.taking -= 1
                        if slot is not None:
                            endpoint.held.append(slot)
                if slot is not None:
                    self._start_linger()
                    return self._use(slot)
            with self._lock:
                if endpoint.free:
                    return self._use(endpoint.free.pop())
                if not endpoint.held:
                    return None  # other processes hold every slot
                expected = endpoint.call_seconds * (endpoint.waiters + 1) / len(endpoint.held)
                # A run hands its slot over to a waiter within RUN_HANDOVER.
                left = until + (RUN_HANDOVER if endpoint.runs else 0.0) - time.monotonic()
                if expected > WAIT_LIMIT or left <= 0:
                    return None
                endpoint.waiters += 1
                try:
                    self._freed.wait(left)
                finally:
                    endpoint.waiters -= 1

    def waiting(self, webhook_id: int) -> bool:
        """Whether a delivery of this process waits for one of the endpoint's slots."""
        with self._lock:
            endpoint = self._endpoints.get(webhook_id)
            return endpoint is not None and endpoint.waiters > 0

    @contextmanager
    def running(self, webhook_id: int) -> Iterator[None]:
        """A run of the endpoint's deliveries holds one of its slots meanwhile: the
        process's other deliveries to it lend it their calls, and one that waits for a
        slot waits RUN_HANDOVER longer before it parks. Calls lent and not taken when
        the run ends go back uncalled."""
        with self._lock:
            endpoint = self._endpoints.setdefault(webhook_id, _Endpoint())
            endpoint.runs += 1
        try:
            yield
        finally:
            with self._lock:
                endpoint.runs -= 1
                back = endpoint.lent if not endpoint.runs else []
                if back:
                    endpoint.lent = []
            for item in back:
                item.done.set()

    def lend(self, webhook_id: int, call: Callable[[Slot], Any], wait: float) -> Lent | None:
        """Hand `call` to a run of the endpoint going on here, for it to make on its slot;
        the item once called, or None: no run, or none took it within `wait` seconds (the
        caller then takes a slot as usual)."""
        item = Lent(call)
        with self._lock:
            endpoint = self._endpoints.get(webhook_id)
            if endpoint is None or not endpoint.runs:
                return None
            endpoint.lent.append(item)
        if not item.done.wait(wait):
            with self._lock:
                if item in endpoint.lent:
                    endpoint.lent.remove(item)
                    return None
            item.done.wait()  # taken: its call ends within its own deadline
        return item if item.called else None

    def waiting_calls(self, webhook_id: int) -> int:
        """Calls lent to the endpoint's run and not taken yet."""
        with self._lock:
            endpoint = self._endpoints.get(webhook_id)
            return 0 if endpoint is None else len(endpoint.lent)

    def lent(self, webhook_id: int) -> list[Lent]:
        """The calls lent to this endpoint's run so far (the run makes each, or sets
        `done` without calling it)."""
        with self._lock:
            endpoint = self._endpoints.get(webhook_id)
            if endpoint is None or not endpoint.lent:
                return []
            items, endpoint.lent = endpoint.lent, []
            return items

    def _use(self, slot: Slot) -> Taken:
        return Taken(slot, self)

    def _give(self, slot: Slot, seconds: float | None) -> None:
        if slot.session is None:
            slot.close_connections()
            return
        with self._lock:
            endpoint = self._endpoints[slot.webhook_id]
            if seconds is not None:
                before = endpoint.call_seconds or seconds
                endpoint.call_seconds = 0.8 * before + 0.2 * seconds
            slot.freed_at = time.monotonic()
            # Beyond this process's share of the endpoint's slots: back at once, so
            # another delivery process busy with the endpoint gets it.
            beyond = len(endpoint.held) > self._share()
            if beyond:
                endpoint.held.remove(slot)
            else:
                endpoint.free.append(slot)
                self._freed.notify_all()
        if beyond:
            self._unlock(slot)

    def _share(self) -> int:
        """This process's share of an endpoint's slots: the limit over the delivery
        workers alive (at least one). Held under self._lock."""
        return max(1, -(-self.limit() // max(1, self._workers)))

    def _count_workers(self, session: psycopg.Connection) -> None:
        if time.monotonic() - self._workers_at < SHARE_REFRESH_SECONDS:
            return
        from jobs.events.signing import WEBHOOK_QUEUE

        stale = max(5.0, 3 * settings.JOBS_PRESENCE_SECONDS)
        row = session.execute(_DELIVERY_WORKERS_SQL, [WEBHOOK_QUEUE, stale]).fetchone()
        with self._lock:
            self._workers, self._workers_at = max(1, row[0]), time.monotonic()

    def _lock_one(self, webhook_id: int, numbers: list[int]) -> Slot | None:
        # A kept session the server ended while it waited (a restart, an operator's
        # pg_terminate_backend) fails at its first use: one new session tries again, so
        # a dead spare never parks a delivery whose endpoint has a free slot.
        for spare_allowed in (True, False):
            session = self._session(spare_allowed)
            if session is None:
                return None
            try:
                self._count_workers(session)
                for number in random.sample(numbers, len(numbers)):
                    row = session.execute(_TAKE_SQL, [ENDPOINT_LOCK_SPACE + number, webhook_id])
                    if row.fetchone()[0]:
                        return Slot(webhook_id, number, session)
            except psycopg.Error as exc:
                log.warning("endpoint slot session failed: %s", exc)
                session.close()
                continue
            self._spare_session(session)
            return None
        return None

    def _session(self, spare_allowed: bool = True) -> psycopg.Connection | None:
        with self._lock:
            if self._spare and spare_allowed:
                return self._spare.pop()
        from jobs.presence import direct_connection_params

        try:
            return psycopg.connect(**direct_connection_params(), autocommit=True)
        except psycopg.Error as exc:
            log.warning("could not open an endpoint slot session: %s", exc)
            return None

    def _spare_session(self, session: psycopg.Connection) -> None:
        with self._lock:
            if len(self._spare) < SPARE_SESSIONS and not session.closed:
                self._spare.append(session)
                return
        session.close()

    def _start_linger(self) -> None:
        with self._lock:
            if self._linger is not None:
                return
            self._linger = threading.Thread(target=self._linger_loop, name="endpoint-slots",
                                            daemon=True)  # fmt: skip
        self._linger.start()

    def _linger_loop(self) -> None:
        while True:
            time.sleep(LINGER_SECONDS / 2)
            self.release_idle(LINGER_SECONDS)

    def release_idle(self, linger: float = 0.0) -> int:
        """Give back the slots free for `linger` seconds; how many."""
        now = time.monotonic()
        idle: list[Slot] = []
        with self._lock:
            for endpoint in self._endpoints.values():
                for slot in [s for s in endpoint.free if now - s.freed_at >= linger]:
                    endpoint.free.remove(slot)
                    endpoint.held.remove(slot)
                    idle.append(slot)
        for slot in idle:
            self._unlock(slot)
        return len(idle)

    def _unlock(self, slot: Slot) -> None:
        """Release a slot no longer held here (its lock, its connections)."""
        slot.close_connections()
        try:
            slot.session.execute(_GIVE_SQL, [ENDPOINT_LOCK_SPACE + slot.number,
                                             slot.webhook_id])  # fmt: skip
        except psycopg.Error as exc:
            log.warning("could not give back webhook %s's slot, closing its session: %s",
                        slot.webhook_id, exc)  # fmt: skip
            slot.session.close()
            return
        self._spare_session(slot.session)

    def close(self) -> None:
        """Give back every free slot and close the spare sessions (a stopping worker;
        a slot in use goes back when its session ends with the process)."""
        self.release_idle()
        with self._lock:
            spare, self._spare = self._spare, []
        for session in spare:
            session.close()

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's sessions and slots are the parent's (its
        locks); the child starts with none and never closes those."""
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._endpoints = {}
        self._spare = []
        self._linger = None
        self._workers_at = -SHARE_REFRESH_SECONDS


SLOTS = Slots()
os.register_at_fork(after_in_child=SLOTS.forget_after_fork)
