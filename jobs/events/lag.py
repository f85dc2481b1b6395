"""How far behind each outbox subscriber is: its cursor against its source's newest
rows, read for runreaper's gauges, the admin's dashboard and `manage.py outbox list`.

Its own room because it is read by scrapes and pages, never by the dispatcher
(jobs.events.outbox) whose progress it reports: a read of every cursor, capped so a
scrape stays cheap however far behind.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db import DatabaseError, InterfaceError, connection
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from jobs import metrics
from jobs.events.sources import SOURCES, Source

# The outbox's logger, as before the lag had a module of its own.
log = logging.getLogger("jobs.events.outbox")

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


def _lag_sql(source: Source) -> str:
    return _LAG_SQL.format(table=source.table, rows=source.rows_sql, cursors=source.cursors_sql)


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
            cur.execute(_lag_sql(source), [LAG_EVENTS_CAP])
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
