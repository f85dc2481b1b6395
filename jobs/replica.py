"""Reads that may lag: a streaming replica for the pages and scrapes that tolerate it.

Only code that says so reads from the replica: a block under `reads()` (the API's
listings and history, the admin's list pages, the metrics collectors, reports). Every
other read, every write, claim and fenced compare-and-set stays on the primary; so does
a job read by id, which is how a client reads its own write (D147). A client that
wrote through the API is pinned to the primary for its listings as long as the lag
bound (`pin`, through the shared cache), and a replica further behind than
JOBS_REPLICA_MAX_LAG_SECONDS, or not streaming, is not used at all (D148).

The database alias is `replica` (DATABASES["replica"], DATABASE_REPLICA_URL in the
deployment); without it everything here reads the primary.
"""

from __future__ import annotations

import contextvars
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import DEFAULT_DB_ALIAS, DatabaseError, InterfaceError, connections

from jobs import metrics
from jobs.conf import settings

ALIAS = "replica"

# The alias reads go to in this context (None: Django's default routing, the primary).
_reading: contextvars.ContextVar[str | None] = contextvars.ContextVar("replica", default=None)

# Seconds the replica is behind: 0 when it has replayed all it received; else since the
# last transaction it replayed. NULL (unknown, not used) when it is not streaming.
LAG_SQL = """
SELECT CASE
  WHEN NOT EXISTS (SELECT 1 FROM pg_stat_wal_receiver WHERE status = 'streaming') THEN NULL
  WHEN pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() THEN 0.0
  ELSE extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp())::float8
END"""


def configured() -> bool:
    return ALIAS in connections.settings


class _Lag:
    """The replica's lag, measured at most once per JOBS_REPLICA_LAG_CHECK_SECONDS per
    process (every request would otherwise pay a round trip to the replica)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at = -math.inf
        self._value: float | None = None

    def measure(self) -> float | None:
        try:
            with connections[ALIAS].cursor() as cur:
                cur.execute(LAG_SQL)
                value = cur.fetchone()[0]
            value = None if value is None else max(0.0, value)
        except (DatabaseError, InterfaceError):
            metrics.DB_ERRORS.labels(op="replica").inc()
            connections[ALIAS].close()
            value = None
        return value

    def get(self) -> float | None:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= settings.JOBS_REPLICA_LAG_CHECK_SECONDS:
                self._value = self.measure()
                self._at = now
            return self._value

    def forget(self) -> None:
        with self._lock:
            self._at = -math.inf


lag = _Lag()


def usable() -> bool:
    """A replica is configured, streaming and within the lag bound."""
    if not configured():
        return False
    seconds = lag.get()
    return seconds is not None and seconds <= settings.JOBS_REPLICA_MAX_LAG_SECONDS


@contextmanager
def reads(client_id: int | None = None) -> Iterator[str]:
    """Reads in the block go to the replica when it is usable (and `client_id`, if
    given, has not written lately); the alias chosen is yielded."""
    alias = ALIAS if usable() and not pinned(client_id) else DEFAULT_DB_ALIAS
    token = _reading.set(alias)
    try:
        yield alias
    finally:
        _reading.reset(token)


def connection() -> Any:
    """The connection for a raw read here: the replica inside `reads()`, else the primary."""
    return connections[_reading.get() or DEFAULT_DB_ALIAS]


def fetch(sql: str, params: dict[str, Any] | list[Any]) -> list[tuple]:
    """A raw read's rows: on the replica inside `reads()`, else the primary."""
    with connection().cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def close_read_connection() -> None:
    """Scrape threads close what they opened (the replica's connection too)."""
    if configured():
        connections[ALIAS].close()


def _pin_key(client_id: int) -> str:
    return f"replica-pin:{client_id}"


def pin(client_id: int) -> None:
    """`client_id` just wrote: its listings read the primary for the lag bound."""
    if not configured():
        return
    from django.core.cache import caches

    try:
        caches["api_clients"].set(
            _pin_key(client_id), 1, timeout=settings.JOBS_REPLICA_MAX_LAG_SECONDS + 1
        )
    except Exception:  # a hint: the cache down costs staleness within the bound, no error
        metrics.DB_ERRORS.labels(op="replica").inc()


def pinned(client_id: int | None) -> bool:
    if client_id is None:
        return False
    from django.core.cache import caches

    try:
        return caches["api_clients"].get(_pin_key(client_id)) is not None
    except Exception:
        return True  # unknown: the primary is always right


class ReplicaRouter:
    """DATABASE_ROUTERS entry: reads under `reads()` go where it chose; everything else
    is Django's default (the primary). Nothing is migrated on the replica."""

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return _reading.get()

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return DEFAULT_DB_ALIAS

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool:
        return True

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return False if db == ALIAS else None
