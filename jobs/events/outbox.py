"""The outbox dispatcher: history rows → webhook deliveries, the Redis stream, Kafka.

The history (`jobs_jobevent`, written by the jobs table's trigger in the
transaction of each change) is the outbox. Each subscriber keeps a cursor row
and moves it in the same transaction as its work (delivery rows and their jobs,
or the XADDs), so a crash repeats a batch and never skips one, and a rolled-back
change never had a row to dispatch.

Ids are taken before their transactions commit, so a committed row may appear
behind one already handled. A tick therefore reads only up to a *horizon*: the
sequence's value noted at the end of the previous tick, once every transaction
that was in progress then and could hold such an id (of this database, with the
write lock on jobs_jobevent; named by virtual transaction id, D124) has ended.
Every row at or below the horizon is then committed (visible) or rolled back (gone
for good).

Domain events (`jobs_domainevent`, written by `publish()`) are a second `Source` with
ids of their own, read the same way behind their own cursors; only the Kafka sink
relays them.

Run by `runreaper` in a thread (`Dispatcher.run`), `tick()` being one pass.

This module is the loop and its hold on the horizon; beside it (D402): the sources, their
events and bodies (jobs.events.sources), the webhooks relay (jobs.events.relay), the
cursors and their placement (jobs.events.cursors), and how far behind each subscriber is
(jobs.events.lag). The sinks are the relay, jobs.events.streams and jobs.events.kafka.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from django.db import DatabaseError, InterfaceError, close_old_connections, connection, transaction

from jobs import metrics, selectors
from jobs.conf import settings
from jobs.events import kafka
from jobs.events.backlog import Backlog
from jobs.events.cursors import CURSOR_SQL, LOCK_SQL, START_SQL
from jobs.events.reads import Built
from jobs.events.relay import FANOUT_HISTORY, WebhookFanout
from jobs.events.sources import HISTORY, SOURCES, Source
from jobs.events.streams import StreamPublisher
from jobs.runtime import Backoff
from jobs.transport import TransportError

log = logging.getLogger(__name__)

# The transactions in progress now that may hold ids of the source's table: those of
# this database holding its write lock, which an INSERT takes before it draws an id.
# Named by virtual transaction id, which a transaction has from its start: not by
# transaction id, which the newest writer's is not in the snapshot's list of those in
# progress when nothing has committed since it began (xid >= xmax; issue 30), and which a
# first write gets only after drawing its id. Readers and other long transactions (a
# report, a handler that writes no history) do not hold the horizon back.
_SNAPSHOT_SQL = """
SELECT COALESCE(array_agg(DISTINCT l.virtualtransaction), '{}')::text
FROM pg_locks l
WHERE l.locktype = 'relation' AND l.relation = %s::regclass AND l.granted
  AND l.mode = 'RowExclusiveLock'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""
_MOVE_SQL = """
UPDATE jobs_outboxcursor SET last_id = %s, horizon_id = %s, horizon_snapshot = %s,
       updated_at = now()
WHERE name = %s
"""


# --- the dispatcher ----------------------------------------------------------------------


class Dispatcher:
    """Hands every new history row to each subscriber, each behind its own cursor."""

    def __init__(self, subscribers: Sequence | None = None, batch: int = 500,
                 interval: float | None = None,
                 sources: Sequence[Source] = (HISTORY,),
                 built: Built | None = None,
                 backlog: Backlog | None = None) -> None:  # fmt: skip
        if subscribers is None:
            subscribers = [WebhookFanout()]
            if settings.REDIS_URL:
                subscribers.append(StreamPublisher())
        self.subscribers = list(subscribers)
        self.batch = batch
        self.interval = settings.JOBS_OUTBOX_INTERVAL if interval is None else interval
        self.sources = tuple(sources)
        # Shared with the process's other dispatchers by dispatchers(); else its own.
        self.built = Built(keep=2 * batch) if built is None else built
        self._not_started_logged: dict[str, float] = {}
        self.waiting = 0  # ids behind the horizon the last tick noted (run's wait)
        self.backlog = backlog  # told how far behind each tick left it (D409)

    def tick(self) -> int:
        """One pass over every subscriber; the number of events handed out. A subscriber
        that fails (Redis down) rolls back alone and repeats its batch next time."""
        total = 0
        self.waiting = 0
        for source in self.sources:
            for subscriber in self.subscribers:
                try:
                    total += self._tick_one(subscriber, source)
                except TransportError as exc:
                    log.warning("outbox subscriber %s failed, will retry: %s",
                                subscriber.name + source.suffix, exc)  # fmt: skip
        if self.backlog is not None:
            self.backlog.report(self.cursor_names[0], self.waiting, self.batch)
        return total

    def _tick_one(self, subscriber, source: Source = HISTORY) -> int:
        name = subscriber.name + source.suffix
        with transaction.atomic(durable=True), connection.cursor() as cur:
            cur.execute(LOCK_SQL, [name])
            cur.execute(CURSOR_SQL, [name])
            row = cur.fetchone()
            if row is None:
                if not getattr(subscriber, "starts_at_beginning", False):
                    self._not_started(name)
                    return 0
                # A built-in subscriber has a cursor from the migration on; one deleted
                # since starts over rather than skip what it never handled (D192).
                log.warning("outbox subscriber %s had no cursor: starting at the beginning "
                            "of %s", name, source.table)  # fmt: skip
                cur.execute(START_SQL, [name, 0])
                cur.execute(CURSOR_SQL, [name])
                row = cur.fetchone()
            last_id, horizon_id, snapshot, settled = row
            upto = horizon_id if settled and horizon_id is not None else last_id
            events: list = []
            if upto > last_id:
                events = self.built.read(cur, source, last_id, upto, self.batch)
            if events:
                subscriber.handle(events)
            release_held = getattr(subscriber, "release_held", None)
            if release_held is not None:
                release_held()
            full = len(events) == self.batch
            new_last = events[-1].id if full else max(last_id, upto)
            if not full and (horizon_id is None or settled):
                # The next horizon: read the sequence first, then the snapshot, so every
                # transaction holding an id up to it is either over or in the snapshot.
                horizon_id = selectors.last_drawn_id(source.table)
                cur.execute(_SNAPSHOT_SQL, [source.table])
                snapshot = cur.fetchone()[0]
            cur.execute(_MOVE_SQL, [new_last, horizon_id, snapshot, name])
        if horizon_id is not None:  # ids drawn behind the horizon: read next tick
            self.waiting = max(self.waiting, horizon_id - new_last)
        if events:
            metrics.EVENTS_DISPATCHED.labels(name).inc(len(events))
        return len(events)

    def _not_started(self, name: str) -> None:
        """An operator's sink without a cursor relays nothing until told where to start
        (D193): said at once, then every NOT_STARTED_LOG_SECONDS, and in the gauge
        jobs_outbox_not_started (OutboxLagCollector)."""
        now = time.monotonic()
        if now - self._not_started_logged.get(name, -NOT_STARTED_LOG_SECONDS) >= (
            NOT_STARTED_LOG_SECONDS
        ):
            self._not_started_logged[name] = now
            log.warning("outbox subscriber %s is not started and relays nothing: choose where "
                        "it starts with manage.py outbox start %s --from beginning|now|ID",
                        name, name)  # fmt: skip

    @property
    def cursor_names(self) -> list[str]:
        """The cursors this dispatcher moves: one per subscriber and source."""
        return [s.name + source.suffix for source in self.sources for s in self.subscribers]

    def _wait(self, handed: int) -> float:
        """At once after a full batch; soon while a drain writes events faster than a
        tick passes them (its next horizon already holds a quarter of a batch more), so
        a relay that is behind never sleeps a whole interval (issue 41); else the
        interval."""
        if handed >= self.batch:
            return 0.0
        if handed and self.waiting >= self.batch // BEHIND_SHARE:
            return min(BEHIND_WAIT, self.interval)
        return self.interval

    def run(self, stop: threading.Event) -> None:
        """Tick every `interval` until `stop` is set (at once again after a full batch)."""
        backoff = Backoff(max(self.interval, 0.1), 30.0)
        names = ", ".join(s.name for s in self.subscribers)
        log.info("outbox dispatcher started: %s, interval %.2fs", names, self.interval)
        try:
            while not stop.is_set():
                close_old_connections()
                try:
                    handed = self.tick()
                    backoff.reset()
                    wait = self._wait(handed)
                except (DatabaseError, InterfaceError) as exc:
                    metrics.DB_ERRORS.labels(op="outbox").inc()
                    log.warning("outbox tick failed, postgres unavailable: %s", exc)
                    connection.close()
                    wait = backoff.next()
                stop.wait(wait)
        finally:
            for subscriber in self.subscribers:
                if hasattr(subscriber, "close"):  # hand what is in flight over first
                    subscriber.close()
            connection.close()


# Behind: the horizon a tick noted holds a quarter of a batch or more past its cursor;
# the next tick waits only for the writers in the horizon's snapshot to end
# (milliseconds). Not less: a tick's own statements (two reads of pg_locks) cost about
# as much as reading a few hundred events.
BEHIND_SHARE = 4
BEHIND_WAIT = 0.05

# Events per tick of the reaper's dispatchers: a drain writes thousands of history rows
# a second, and each tick's statements cost about the same for 500 rows or 2,000.
DISPATCH_BATCH = 2000
# How often a sink without a cursor is named again in the log (Dispatcher._not_started).
NOT_STARTED_LOG_SECONDS = 300.0


def dispatchers() -> list[Dispatcher]:
    """The dispatchers a runreaper runs, each in a thread of its own: the webhooks, the
    stream (with Redis) and the Kafka sink (when configured), so none waits for another's
    tick (a broker that is slow or away, a fan-out of many deliveries) and each keeps up
    with a drain on its own (issue 41)."""
    # Read and built once for the three; the window keeps a few batches for the ones that
    # follow. The fan-out takes its range from there when the window holds it (D394).
    built = Built(keep=4 * DISPATCH_BATCH)
    # The fan-out and the stream, a batch behind, ask the deliveries to wait (D409); Kafka
    # does not: a slow broker is not work the deliveries take cores from.
    backlog = Backlog()
    found = [Dispatcher([WebhookFanout()], batch=DISPATCH_BATCH, sources=(FANOUT_HISTORY,),
                        built=built, backlog=backlog)]  # fmt: skip
    if settings.REDIS_URL:
        found.append(Dispatcher([StreamPublisher()], batch=DISPATCH_BATCH, built=built,
                                backlog=backlog))  # fmt: skip
    if kafka.configured():  # the domain events of publish() too, behind a cursor of their own
        found.append(Dispatcher([kafka.KafkaSink()], batch=kafka.BATCH, sources=SOURCES,
                                built=built))  # fmt: skip
    # With the stream or Kafka following, the fan-out first to a range reads it whole (D397).
    built.lead = len(found) > 1
    return found
