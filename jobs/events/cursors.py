"""Where each outbox subscriber stands: its cursor row, and placing it (D192, D193).

Its own room because an operator places cursors (`manage.py outbox start`) from a
process that runs no dispatcher; the dispatcher (jobs.events.outbox) takes the same
lock and reads the same row (LOCK_SQL, CURSOR_SQL) before every tick, so a placement
waits for a tick in progress and the next one reads the new position.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.db import connection, transaction

from jobs import selectors
from jobs.events.sources import DOMAIN, HISTORY

# The outbox's logger, as before the placement had a module of its own.
log = logging.getLogger("jobs.events.outbox")

# One tick per subscriber at a time across every reaper. An advisory lock rather than a
# row lock: a tick waiting on an outside system (the Kafka broker) then holds no
# transaction id, so it never holds the other subscribers' horizon back.
LOCK_SQL = "SELECT pg_advisory_xact_lock(hashtext('jobs_outboxcursor'), hashtext(%s))"
# Settled: every transaction noted with the horizon has ended, its own lock on its
# virtual transaction id gone. (A number: a transaction id noted by an earlier release.)
CURSOR_SQL = """
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
START_SQL = """
INSERT INTO jobs_outboxcursor (name, last_id, updated_at) VALUES (%s, %s, now())
ON CONFLICT (name) DO NOTHING
"""
_MOVE_TO_SQL = """
UPDATE jobs_outboxcursor SET last_id = %s, horizon_id = NULL, horizon_snapshot = NULL,
       updated_at = now()
WHERE name = %s
"""
_NEWEST_SQL = "SELECT COALESCE(max(id), 0) FROM {table}"

BEGINNING, NOW = "beginning", "now"
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
        cur.execute(LOCK_SQL, [name])
        cur.execute(CURSOR_SQL, [name])
        row = cur.fetchone()
        was = None if row is None else row[0]
        if was is not None and not move:
            raise CursorExists(name, was)
        if position == BEGINNING:
            last_id = 0
        elif position == NOW:
            cur.execute(_NEWEST_SQL.format(table=source.table))
            last_id = cur.fetchone()[0]
        else:
            last_id = int(position)
            drawn = selectors.last_drawn_id(source.table)
            if not 0 <= last_id <= drawn:
                raise ValueError(f"{source.table} has ids up to {drawn}: {last_id} is not one")
        cur.execute(START_SQL if was is None else _MOVE_TO_SQL,
                    [name, last_id] if was is None else [last_id, name])  # fmt: skip
    log.warning("outbox subscriber %s placed after event %s of %s (was %s)",
                name, last_id, source.table, "not started" if was is None else was)  # fmt: skip
    return Placed(name, last_id, was)
