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
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import orjson
from django.db import DatabaseError, InterfaceError, close_old_connections, connection, transaction
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from jobs import admission, metrics, selectors, services
from jobs.conf import settings
from jobs.events import domain_event_body, fanout, kafka, signing
from jobs.events.reads import Built, binary_rows
from jobs.events.streams import StreamPublisher
from jobs.lifecycle import TERMINAL, sql_list
from jobs.runtime import Backoff
from jobs.transport import TransportError

log = logging.getLogger(__name__)

# One tick per subscriber at a time across every reaper. An advisory lock rather than a
# row lock: a tick waiting on an outside system (the Kafka broker) then holds no
# transaction id, so it never holds the other subscribers' horizon back.
_LOCK_SQL = "SELECT pg_advisory_xact_lock(hashtext('jobs_outboxcursor'), hashtext(%s))"
# Settled: every transaction noted with the horizon has ended, its own lock on its
# virtual transaction id gone. (A number: a transaction id noted by an earlier release.)
_CURSOR_SQL = """
SELECT c.last_id, c.horizon_id, c.horizon_snapshot,
       c.horizon_snapshot IS NOT NULL AND NOT EXISTS (
         SELECT 1 FROM pg_locks l
         WHERE l.locktype = 'virtualxid' AND l.mode = 'ExclusiveLock' AND l.granted
           AND l.virtualxid = ANY(c.horizon_snapshot::text[]))
       AND NOT EXISTS (
         SELECT 1 FROM unnest(c.horizon_snapshot::text[]) AS x(held)
         WHERE strpos(x.held, '/') = 0
           AND pg_xact_status(x.held::xid8) IS NOT DISTINCT FROM 'in progress')
FROM jobs_outboxcursor c WHERE c.name = %s
"""
# A cursor placed where its subscriber starts: after `last_id` (0: the beginning). A new
# one has no horizon yet; a moved one forgets its own (the next tick notes a fresh one).
_START_SQL = """
INSERT INTO jobs_outboxcursor (name, last_id, updated_at) VALUES (%s, %s, now())
ON CONFLICT (name) DO NOTHING
"""
_MOVE_TO_SQL = """
UPDATE jobs_outboxcursor SET last_id = %s, horizon_id = NULL, horizon_snapshot = NULL,
       updated_at = now()
WHERE name = %s
"""
_NEWEST_SQL = "SELECT COALESCE(max(id), 0) FROM {table}"
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
_EVENT_COLUMNS = """e.id, e.job_id, e.at, e.from_status, e.to_status, e.lease_version, e.seq,
       j.client_id, j.task, j.queue, j.priority, j.status, j.payload, j.result, j.error,
       j.retry_count, j.max_retries, j.lease_version, j.idempotency_key, j.run_at,
       j.created_at, j.updated_at, j.finished_at, j.progress, j.cancel_requested_at,
       d.id, d.webhook_id, d.source_job_id, j.trace_context"""
_EVENT_JOINS = """LEFT JOIN jobs_job j ON j.id = e.job_id
LEFT JOIN jobs_webhookdelivery d ON d.job_id = e.job_id"""
# The batch's history rows first, then their jobs and deliveries (D396): with the join
# under the LIMIT, the planner (on a freshly written range its statistics do not know)
# joined every row up to the horizon, a drain's 20,000, and kept 2,000: five times the
# read's cost, growing with the backlog.
_RANGE_SQL = """
WITH e AS MATERIALIZED (
  SELECT e.id, e.job_id, e.at, e.from_status, e.to_status, e.lease_version, e.seq
  FROM jobs_jobevent e
  WHERE e.id > %s AND e.id <= %s AND e.kind = 'transition'
  ORDER BY e.id
  LIMIT %s)
SELECT {columns}
FROM e
{joins}
ORDER BY e.id
"""
_EVENTS_SQL = _RANGE_SQL.format(columns=_EVENT_COLUMNS, joins=_EVENT_JOINS)
_JOB_FIELDS = ("task", "queue", "priority", "status", "payload", "result", "error",
               "retry_count", "max_retries", "lease_version", "idempotency_key", "run_at",
               "created_at", "updated_at", "finished_at", "progress",
               "cancel_requested_at")  # fmt: skip


# The row's columns of JSON (payload, result, error, progress): the rest are integers,
# strings, timestamps and NULLs.
_JSON_COLUMNS = tuple(8 + _JOB_FIELDS.index(f) for f in ("payload", "result", "error", "progress"))

# What orjson may write differently from json.dumps(ensure_ascii=True), besides anything
# outside printable ASCII (json escapes it as \uXXXX, DEL included): a float (the two
# spell some apart: 1e-05 and 0.00001), whose token ends in a fraction or an exponent.
# A match inside a string only costs the fallback.
_FLOAT = re.compile(rb"[.eE][-+]?\d+[,}\]]")


def _iso(value: Any) -> Any:
    return value.isoformat().replace("+00:00", "Z") if isinstance(value, datetime) else value


def _dumps(body: dict[str, Any], floats: bool = True) -> str:
    """json.dumps(body, separators=(",", ":")) with datetimes as _iso, byte for byte:
    by orjson (several times faster, the relay's main cost per event) where nothing in
    its output can differ, else by json. `floats` False: the caller knows the body holds
    no float, and the search for one (half of a body's CPU, D384) is skipped."""
    try:
        out = orjson.dumps(body, option=orjson.OPT_UTC_Z)
    except (orjson.JSONEncodeError, TypeError):  # an integer past 64 bits, a deep nesting
        out = None
    if out is None or not out.isascii() or b"\x7f" in out or (floats and _FLOAT.search(out)):
        return json.dumps(body, separators=(",", ":"), default=_iso)
    return out.decode()


def _has_float(value: Any) -> bool:
    """Whether a parsed JSON value holds a float anywhere (its only floats)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


@dataclass(slots=True)
class OutboxEvent:
    """One lifecycle event and the message every subscriber sends for it."""

    id: int
    job_id: int
    client_id: int | None
    type: str
    seq: int | None
    to_status: str
    msg_id: str
    # Set when the job is itself a webhook delivery: (delivery id, webhook, source job).
    delivery: tuple[int, int, int] | None
    row: Sequence[Any] | None = field(repr=False)  # None: read narrow (with_rows reads it)
    _body: str | None = field(default=None, repr=False)
    trace: str | None = None  # the job's trace context (jobs.observability), carried on

    @property
    def key(self) -> str:
        """The Kafka key: the job id, so one job's events share a partition."""
        return str(self.job_id)

    @property
    def body(self) -> str:
        """The message, made when a subscriber first needs it: the webhooks fan-out
        needs it only for the events a webhook takes."""
        if self._body is None:
            self._body = _body(self.row, self.msg_id, self.type)
        return self._body


def _event(row: Sequence[Any]) -> OutboxEvent:
    event_id, job_id, to_status, seq, client_id = row[0], row[1], row[4], row[6], row[7]
    return OutboxEvent(
        event_id, job_id, client_id, signing.event_type(to_status), seq, to_status,
        signing.message_id(event_id), tuple(row[25:28]) if row[25] is not None else None, row,
        trace=row[28],
    )  # fmt: skip


def _body(row: Sequence[Any], msg_id: str, kind: str) -> str:
    _, job_id, at, from_status, to_status, lease_version, seq = row[:7]
    job: dict[str, Any] = {"id": job_id}
    floats = False
    if row[8] is not None:  # None: the job was deleted by retention since
        job.update(zip(_JOB_FIELDS, row[8:25], strict=True))  # read binary: JSON parsed
        # Its JSON (payload, result, error, progress) holds its only floats, if any.
        floats = any(_has_float(row[i]) for i in _JSON_COLUMNS)
    job.update({"from": from_status, "to": to_status, "lease_version": lease_version,
                "seq": seq})  # fmt: skip
    body = {"id": msg_id, "type": kind, "created_at": at, "data": job}
    return _dumps(body, floats)


# --- domain events ----------------------------------------------------------------------

_DOMAIN_EVENTS_SQL = """
SELECT e.id, e.type, e.payload, e.at, e.key
FROM jobs_domainevent e
WHERE e.id > %s AND e.id <= %s
ORDER BY e.id
LIMIT %s
"""


@dataclass(slots=True)
class DomainOutboxEvent:
    """One event of `publish()`, with the body its subscribers got."""

    id: int
    type: str
    msg_id: str
    body: str
    key: str  # the publisher's, else the event id


def _domain_event(row: Sequence[Any]) -> DomainOutboxEvent:
    event_id, kind, payload, at, key = row
    if isinstance(payload, str):
        payload = json.loads(payload)
    body = domain_event_body(event_id, kind, payload, at)
    return DomainOutboxEvent(event_id, kind, body["id"], json.dumps(body, separators=(",", ":")),
                             key or body["id"])  # fmt: skip


# --- sources ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A table of events whose ids are drawn in their writers' transactions: each gets
    its own cursor per subscriber (named subscriber + suffix) behind the same horizon."""

    table: str
    suffix: str
    events_sql: str
    event: Callable[[Sequence[Any]], Any]
    # Which cursors are this source's, and which of its rows count as lag.
    cursors_sql: str
    rows_sql: str
    # Read in binary: timestamps by psycopg's C loaders, JSON parsed by psycopg (a JSON
    # string too), a third of the read's CPU in text.
    binary: bool = False
    # Narrow rows (the webhooks fan-out's): never stored in a shared window, but served
    # from one that holds the whole rows of the range (Built.read, D394).
    narrow: bool = False
    # The whole rows of a narrow source: what it reads through the shared window when
    # it is the first to reach a range (Built.read, D397).
    wide: Source | None = None

    @property
    def newest_sql(self) -> str:
        return _NEWEST_SQL.format(table=self.table)

    @property
    def lag_sql(self) -> str:
        return _LAG_SQL.format(table=self.table, rows=self.rows_sql, cursors=self.cursors_sql)


HISTORY = Source("jobs_jobevent", "", _EVENTS_SQL, _event,
                 cursors_sql="c.name NOT LIKE '%%.domain'",
                 rows_sql="e.kind = 'transition'", binary=True)  # fmt: skip
DOMAIN = Source("jobs_domainevent", ".domain", _DOMAIN_EVENTS_SQL, _domain_event,
                cursors_sql="c.name LIKE '%%.domain'", rows_sql="true")  # fmt: skip
SOURCES = (HISTORY, DOMAIN)

# What the webhooks fan-out needs of every event: whose job it is and whether the job is
# a delivery. The whole row (the body) is read for the events a webhook takes only.
_FANOUT_EVENTS_SQL = _RANGE_SQL.format(
    columns="e.id, e.job_id, e.to_status, e.seq, j.client_id, d.id, d.webhook_id, d.source_job_id",
    joins=_EVENT_JOINS,
)
_EVENTS_BY_ID_SQL = f"""
SELECT {_EVENT_COLUMNS}
FROM jobs_jobevent e
{_EVENT_JOINS}
WHERE e.id = ANY(%s)
"""


def _fanout_event(row: Sequence[Any]) -> OutboxEvent:
    event_id, job_id, to_status, seq, client_id = row[:5]
    return OutboxEvent(
        event_id, job_id, client_id, signing.event_type(to_status), seq, to_status,
        signing.message_id(event_id), tuple(row[5:8]) if row[5] is not None else None, None,
    )  # fmt: skip


def with_rows(events: Sequence[OutboxEvent]) -> None:
    """Read the whole row of each event read narrow (FANOUT_HISTORY), in one statement."""
    missing = {e.id: e for e in events if e.row is None}
    if missing:
        for row in binary_rows(_EVENTS_BY_ID_SQL, [list(missing)]):
            missing[row[0]].row = row


# The history as the webhooks fan-out reads it: the same events, narrow rows (D262).
FANOUT_HISTORY = replace(HISTORY, events_sql=_FANOUT_EVENTS_SQL, event=_fanout_event,
                         narrow=True, wide=HISTORY)  # fmt: skip


# --- webhooks ---------------------------------------------------------------------------

# `after_event_id`: the last history id drawn when the webhook was created; it gets the
# events after it only (NULL, a webhook from before that was noted: every event).
_WEBHOOKS_SQL = """
SELECT id, client_id, events, COALESCE(after_event_id, 0)
FROM jobs_webhook WHERE enabled AND client_id = ANY(%s)
"""
# Idle chains whose first waiting delivery has no job: those a full queue held back
# (D110). The partial index delivery_waiting_idx holds waiting deliveries only.
_HELD_SQL = f"""
SELECT DISTINCT ON (d.webhook_id, d.source_job_id) d.id FROM jobs_webhookdelivery d
WHERE d.job_id IS NULL AND NOT EXISTS (
  SELECT 1 FROM jobs_webhookdelivery b JOIN jobs_job j ON j.id = b.job_id
  WHERE b.webhook_id = d.webhook_id AND b.source_job_id = d.source_job_id
    AND j.status NOT IN ({sql_list(TERMINAL)}))
ORDER BY d.webhook_id, d.source_job_id, d.seq, d.id
LIMIT %s
"""
_ATTACH_SQL = """
UPDATE jobs_webhookdelivery d SET job_id = u.job_id
FROM unnest(%s::bigint[], %s::bigint[]) AS u(id, job_id) WHERE d.id = u.id
"""
# A delivery job goes on in its source job's trace (D303): its call's `traceparent`.
_CARRY_TRACE_SQL = """
UPDATE jobs_job j SET trace_context = s.trace_context
FROM jobs_webhookdelivery d JOIN jobs_job s ON s.id = d.source_job_id
WHERE d.id = ANY(%s) AND j.id = d.job_id AND s.trace_context IS NOT NULL
"""


class WebhookFanout:
    """One delivery row per (event, matching webhook), written waiting; then each chain
    (webhook, source job) whose delivery job is not running gets a job for its first
    waiting delivery, so one job's events reach one endpoint in seq order. A delivery
    job's own terminal event is how the next one of its chain is released."""

    name = "webhooks"
    starts_at_beginning = True  # each webhook picks its own start (after_event_id)

    def __init__(self) -> None:
        self._maybe_held = True  # a previous process may have held some back

    def handle(self, events: Sequence[OutboxEvent]) -> int:
        hooks = self._webhooks({e.client_id for e in events if e.client_id is not None})
        taken: list[tuple[int, OutboxEvent]] = []
        for e in events:
            for hook_id, types, after in hooks.get(e.client_id, ()):
                if e.id > after and (signing.ALL_EVENTS in types or e.type in types):
                    taken.append((hook_id, e))
        with_rows([e for _, e in taken])
        rows = [(hook_id, e.id, e.job_id, e.seq or 0, e.type, e.body) for hook_id, e in taken]
        chains = {(r[0], r[2]) for r in rows}
        chains |= {(d[1], d[2]) for d in (e.delivery for e in events) if d is not None}
        if not chains:
            return 0
        # The rows, the idle chains' jobs and their attachment: one statement (D262).
        done = fanout.fan_out(rows, chains, self._room(), "api:outbox")
        if done.held:
            self._maybe_held = True
            transaction.on_commit(lambda: metrics.WEBHOOK_DELIVERIES_HELD.inc(done.held))
        if done.released:
            admission.count_accepted({signing.WEBHOOK_QUEUE: done.released})
        return len(rows)

    def release_held(self) -> int:
        """Give jobs to the chains a full queue held back, as far as the queue has room
        now; called on every tick, inside the dispatcher's transaction. Reads only when
        something may be held: after a hold, and once when the process starts."""
        if not self._maybe_held:
            return 0
        room = self._room()
        if room <= 0:
            return 0
        with connection.cursor() as cur:
            cur.execute(_HELD_SQL, [room + 1])
            ready = [r[0] for r in cur.fetchall()]
            self._maybe_held = len(ready) > room
            return self._release(cur, ready)

    def _room(self) -> int:
        limit = settings.JOBS_MAX_QUEUE_DEPTH
        return limit - admission.queue_depth(signing.WEBHOOK_QUEUE, limit)

    def _release(self, cur, ready: list[int]) -> int:
        """One delivery job per ready chain while the webhooks queue has room; the rest
        wait (job_id NULL, counted) for `release_held`."""
        if not ready:
            return 0
        room = max(self._room(), 0)
        if room < len(ready):
            self._maybe_held = True
            held = len(ready) - room
            transaction.on_commit(lambda: metrics.WEBHOOK_DELIVERIES_HELD.inc(held))
            ready = ready[:room]
        if ready:
            submitted = services.submit_many(
                [services.NewJob(signing.DELIVER_TASK, {"delivery_id": d},
                                 queue=signing.WEBHOOK_QUEUE,
                                 max_retries=settings.JOBS_WEBHOOK_MAX_RETRIES)
                 for d in ready],
                actor="api:outbox",
            )  # fmt: skip
            cur.execute(_ATTACH_SQL, [ready, [s.job_id for s in submitted]])
            cur.execute(_CARRY_TRACE_SQL, [ready])  # submit_many counted them (backpressure)
        return len(ready)

    @staticmethod
    def _webhooks(client_ids: set[int]) -> dict[int, list[tuple[int, list[str], int]]]:
        if not client_ids:
            return {}
        out: dict[int, list[tuple[int, list[str], int]]] = defaultdict(list)
        with connection.cursor() as cur:
            cur.execute(_WEBHOOKS_SQL, [sorted(client_ids)])
            for hook_id, client_id, types, after in cur.fetchall():
                out[client_id].append((hook_id, types, after))
        return out


# --- the dispatcher ----------------------------------------------------------------------


class Dispatcher:
    """Hands every new history row to each subscriber, each behind its own cursor."""

    def __init__(self, subscribers: Sequence | None = None, batch: int = 500,
                 interval: float | None = None,
                 sources: Sequence[Source] = (HISTORY,),
                 built: Built | None = None) -> None:  # fmt: skip
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
        return total

    def _tick_one(self, subscriber, source: Source = HISTORY) -> int:
        name = subscriber.name + source.suffix
        with transaction.atomic(durable=True), connection.cursor() as cur:
            cur.execute(_LOCK_SQL, [name])
            cur.execute(_CURSOR_SQL, [name])
            row = cur.fetchone()
            if row is None:
                if not getattr(subscriber, "starts_at_beginning", False):
                    self._not_started(name)
                    return 0
                # A built-in subscriber has a cursor from the migration on; one deleted
                # since starts over rather than skip what it never handled (D192).
                log.warning("outbox subscriber %s had no cursor: starting at the beginning "
                            "of %s", name, source.table)  # fmt: skip
                cur.execute(_START_SQL, [name, 0])
                cur.execute(_CURSOR_SQL, [name])
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


def dispatchers() -> list[Dispatcher]:
    """The dispatchers a runreaper runs, each in a thread of its own: the webhooks, the
    stream (with Redis) and the Kafka sink (when configured), so none waits for another's
    tick (a broker that is slow or away, a fan-out of many deliveries) and each keeps up
    with a drain on its own (issue 41)."""
    # Read and built once for the three; the window keeps a few batches for the ones that
    # follow. The fan-out takes its range from there when the window holds it (D394).
    built = Built(keep=4 * DISPATCH_BATCH)
    found = [Dispatcher([WebhookFanout()], batch=DISPATCH_BATCH, sources=(FANOUT_HISTORY,),
                        built=built)]  # fmt: skip
    if settings.REDIS_URL:
        found.append(Dispatcher([StreamPublisher()], batch=DISPATCH_BATCH, built=built))
    if kafka.configured():  # the domain events of publish() too, behind a cursor of their own
        found.append(Dispatcher([kafka.KafkaSink()], batch=kafka.BATCH, sources=SOURCES,
                                built=built))  # fmt: skip
    # With the stream or Kafka following, the fan-out first to a range reads it whole (D397).
    built.lead = len(found) > 1
    return found


# --- where a subscriber starts ----------------------------------------------------------

BEGINNING, NOW = "beginning", "now"
NOT_STARTED_LOG_SECONDS = 300.0
# Every cursor a deployment may have: the built-in subscribers' (created by migration
# 0024, from the beginning) and the Kafka sink's two, which an operator starts (D193).
BUILT_IN = ("webhooks", "stream")
CURSORS = {"webhooks": HISTORY, "stream": HISTORY, "kafka": HISTORY, "kafka.domain": DOMAIN}


class CursorExists(Exception):
    """The subscriber has a position already; moving it skips or repeats events."""

    def __init__(self, name: str, last_id: int) -> None:
        super().__init__(f"{name} is already started, at event {last_id}")
        self.last_id = last_id


@dataclass(frozen=True, slots=True)
class Placed:
    name: str
    last_id: int  # the subscriber's next event is the first after it
    was: int | None  # where it stood before (None: it had no cursor)


def start_cursor(name: str, position: str | int) -> Placed:
    """Give subscriber `name` (a key of CURSORS) its first position: after `position`,
    BEGINNING, NOW (the newest event written) or an event id. Raises CursorExists."""
    return _place(name, position, move=False)


def move_cursor_skipping_or_repeating(name: str, position: str | int) -> Placed:
    """Move subscriber `name` anywhere, started or not: forward skips events, back
    sends them again (consumers dedupe on the event id)."""
    return _place(name, position, move=True)


def _place(name: str, position: str | int, *, move: bool) -> Placed:
    source = CURSORS[name]
    # Under the subscriber's lock: a tick in progress finishes first and the next one
    # reads the new position.
    with transaction.atomic(durable=True), connection.cursor() as cur:
        cur.execute(_LOCK_SQL, [name])
        cur.execute(_CURSOR_SQL, [name])
        row = cur.fetchone()
        was = None if row is None else row[0]
        if was is not None and not move:
            raise CursorExists(name, was)
        if position == BEGINNING:
            last_id = 0
        elif position == NOW:
            cur.execute(source.newest_sql)
            last_id = cur.fetchone()[0]
        else:
            last_id = int(position)
            drawn = selectors.last_drawn_id(source.table)
            if not 0 <= last_id <= drawn:
                raise ValueError(f"{source.table} has ids up to {drawn}: {last_id} is not one")
        cur.execute(_START_SQL if was is None else _MOVE_TO_SQL,
                    [name, last_id] if was is None else [last_id, name])  # fmt: skip
    log.warning("outbox subscriber %s placed after event %s of %s (was %s)",
                name, last_id, source.table, "not started" if was is None else was)  # fmt: skip
    return Placed(name, last_id, was)


# --- how far behind -------------------------------------------------------------------------

# The count stops at LAG_EVENTS_CAP so a scrape stays cheap however far behind.
_LAG_SQL = """
SELECT c.name, COALESCE(extract(epoch FROM now() - (
         SELECT e.at FROM {table} e
         WHERE e.id > c.last_id AND {rows} ORDER BY e.id LIMIT 1)), 0),
       (SELECT count(*) FROM (
          SELECT 1 FROM {table} e WHERE e.id > c.last_id AND {rows}
          LIMIT %s) AS behind),
       c.last_id, c.updated_at
FROM jobs_outboxcursor c WHERE {cursors} ORDER BY c.name
"""
LAG_EVENTS_CAP = 1_000_000


@dataclass(frozen=True, slots=True)
class Lag:
    subscriber: str
    seconds: float  # age of the oldest event not handled yet; 0: caught up
    events: int  # how many (up to LAG_EVENTS_CAP)
    last_id: int  # the cursor: the last history id handled
    updated_at: datetime


def lag() -> list[Lag]:
    """Each subscriber's cursor and how far behind it is (metrics, admin dashboard)."""
    found: list[Lag] = []
    with connection.cursor() as cur:
        for source in SOURCES:
            cur.execute(source.lag_sql, [LAG_EVENTS_CAP])
            found += [Lag(name, float(seconds), count, last_id, updated)
                      for name, seconds, count, last_id, updated in cur.fetchall()]  # fmt: skip
    return sorted(found, key=lambda row: row.subscriber)


class OutboxLagCollector(Collector):
    """jobs_outbox_lag_seconds{subscriber}: the age of the oldest event a subscriber has
    not handled yet (0 when it is caught up), and jobs_outbox_lag_events{subscriber}: how
    many there are (for kafka: not yet acknowledged by the broker). Grows when the
    dispatcher is stuck, a transaction holds the horizon back, Redis is down for the
    stream or the broker for kafka. Scraped from runreaper; a failed read leaves the
    gauges out of that scrape.

    Given `subscribers` (the cursors its reaper's dispatchers move), it reports those
    only (a stream cursor nobody moves, Redis being off, is no lag), and
    jobs_outbox_not_started{subscriber}: 1 for one with no cursor, which relays nothing
    until an operator starts it (D193)."""

    def __init__(self, subscribers: Sequence[str] | None = None) -> None:
        self.subscribers = None if subscribers is None else sorted(set(subscribers))

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(LAG_NAME, LAG_HELP, labels=["subscriber"])
        yield GaugeMetricFamily(LAG_EVENTS_NAME, LAG_EVENTS_HELP, labels=["subscriber"])
        yield GaugeMetricFamily(NOT_STARTED_NAME, NOT_STARTED_HELP, labels=["subscriber"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(LAG_NAME, LAG_HELP, labels=["subscriber"])
        behind = GaugeMetricFamily(LAG_EVENTS_NAME, LAG_EVENTS_HELP, labels=["subscriber"])
        unstarted = GaugeMetricFamily(NOT_STARTED_NAME, NOT_STARTED_HELP, labels=["subscriber"])
        try:
            rows = lag()
        except (DatabaseError, InterfaceError) as exc:
            metrics.DB_ERRORS.labels(op="outbox").inc()
            log.warning("outbox lag read failed: %s", exc)
            connection.close()
            return
        wanted = self.subscribers
        for row in rows:
            if wanted is None or row.subscriber in wanted:
                family.add_metric([row.subscriber], row.seconds)
                behind.add_metric([row.subscriber], float(row.events))
        yield family
        yield behind
        if wanted is not None:
            started = {row.subscriber for row in rows}
            for name in wanted:
                unstarted.add_metric([name], float(name not in started))
            yield unstarted


LAG_NAME = "jobs_outbox_lag_seconds"
LAG_HELP = "Age of the oldest outbox event a subscriber has not handled yet (0: caught up)"
LAG_EVENTS_NAME = "jobs_outbox_lag_events"
LAG_EVENTS_HELP = "Outbox events a subscriber has not handled yet (counted up to a million)"
NOT_STARTED_NAME = "jobs_outbox_not_started"
NOT_STARTED_HELP = ("1: a configured outbox subscriber has no cursor and relays nothing until "
                    "manage.py outbox start chooses where it starts")  # fmt: skip
