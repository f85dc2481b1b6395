"""The outbox's reads of its sources (jobs.events.sources) for its dispatchers
(jobs.events.outbox): in binary, and built once per reaper for the dispatchers that read
the same rows (issue 41, D270, D380).
"""

from __future__ import annotations

import json
import threading
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import orjson
import psycopg
from django.db import connection
from psycopg.types.json import set_json_loads


def _read(cur, source, after: int, upto: int, limit: int) -> list:
    """The source's first `limit` events after `after` up to `upto`, built."""
    params = [after, upto, limit]
    if source.binary:
        rows = binary_rows(source.events_sql, params)
    else:
        cur.execute(source.events_sql, params)
        rows = cur.fetchall()
    return [source.event(r) for r in rows]


def _json_loads(data: bytes | memoryview) -> Any:
    """orjson's parse where it gives what json's does (all but integers past 64 bits)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(bytes(data))


def binary_rows(sql: str, params: Sequence[Any]) -> list[tuple]:
    """The rows of an outbox read, in binary, by psycopg's C loaders: jsonb parsed by
    orjson, timestamps without the infinities' Python wrapper (jobs.pgtypes), which a
    job's timestamps never hold (set from Python datetimes or now()). Half the read's
    CPU, the relay's largest share (issue 41)."""
    connection.ensure_connection()
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as raw:
        adapters = raw.adapters
        adapters.register_loader("timestamptz", _PLAIN_TIMESTAMPTZ)
        set_json_loads(_json_loads, raw)
        raw.execute(sql, params, binary=True)
        return raw.fetchall()


_PLAIN_TIMESTAMPTZ = psycopg.adapters.get_loader(
    psycopg.adapters.types["timestamptz"].oid, psycopg.pq.Format.BINARY
)


def _id(event) -> int:
    return event.id


class Built:
    """The events a dispatcher of this process built last, for the others (issue 41):
    the webhooks, the stream and the Kafka sink read the same rows, and reading and
    building them was most of each one's CPU. It holds, per source, a window (lo, hi]
    with every event in it: read at or below a settled horizon, where every id is
    committed or gone for good, so the rows of a range never change. A dispatcher
    further back or ahead reads the database as before. A body then shows the job as it
    was when the first dispatcher read it, as any of them might have."""

    def __init__(self, keep: int, lead: bool = False) -> None:
        self.keep = keep
        # A narrow reader at the window's front reads whole rows into it: others follow.
        self.lead = lead
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[int, int, list]] = {}
        self._reading: dict[str, threading.Lock] = defaultdict(threading.Lock)
        self.hits = 0  # events served from a window (tests)

    def read(self, cur, source, after: int, upto: int, limit: int) -> list:
        """What `_read` answers, from the window where it holds them. One read of a
        source at a time: dispatchers ticking in step (the stream and Kafka) otherwise
        both miss and read the same rows; the second now finds them in the window."""
        if source.narrow:  # the window's whole rows serve it; its own never go in
            found = self._peek(source, after, upto, limit)
            if found is not None:
                return found
            # First to reach the range (at or past the window's end): its whole rows, read
            # once for the dispatchers that follow (D397). Behind the window, nobody
            # follows: narrow rows, the whole ones of the events a webhook takes only.
            if not (self.lead and source.wide is not None and after >= self._end(source)):
                return _read(cur, source, after, upto, limit)
            source = source.wide
        with self._lock:
            reading = self._reading[source.table]
        with reading:
            return self._from_window(cur, source, after, upto, limit)

    def _end(self, source) -> int:
        with self._lock:
            return self._windows.get(source.table, (0, 0, []))[1]

    def _peek(self, source, after: int, upto: int, limit: int) -> list | None:
        """What `_read` answers if the window holds all of it, else None."""
        with self._lock:
            lo, hi, built = self._windows.get(source.table, (0, 0, []))
        if not lo <= after < hi:
            return None
        start = bisect_right(built, after, key=_id)
        end = bisect_right(built, min(upto, hi), key=_id)
        cached = built[start : min(end, start + limit)]
        if len(cached) == limit or hi >= upto:
            self.hits += len(cached)
            return cached
        return None

    def _from_window(self, cur, source, after: int, upto: int, limit: int) -> list:
        with self._lock:
            lo, hi, built = self._windows.get(source.table, (0, 0, []))
        cached: list = []
        if lo <= after < hi:
            ids = [e.id for e in built]
            start, end = bisect_right(ids, after), bisect_right(ids, min(upto, hi))
            cached = built[start : min(end, start + limit)]
            if len(cached) == limit or hi >= upto:
                self.hits += len(cached)
                return cached
            after = hi
        self.hits += len(cached)
        fresh = _read(cur, source, after, upto, limit - len(cached))
        # Every event after `after` up to here is in `fresh`.
        reached = fresh[-1].id if len(fresh) == limit - len(cached) else upto
        self._add(source.table, after, reached, fresh)
        return cached + fresh

    def _add(self, table: str, after: int, reached: int, fresh: list) -> None:
        with self._lock:
            lo, hi, built = self._windows.get(table, (0, 0, []))
            if after == hi:  # the window goes on
                built = built + fresh
            elif reached > hi:  # ahead of it, or none yet: a new one
                lo, built = after, list(fresh)
            else:
                return
            if len(built) > self.keep:
                lo, built = built[-self.keep - 1].id, built[-self.keep :]
            self._windows[table] = (lo, reached, built)
