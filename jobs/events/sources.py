"""The outbox's sources: the tables it relays, their rows as events, and each event's
JSON body, the message every subscriber sends (jobs.events.outbox dispatches them).

Its own room because every sink and reader of the outbox shares it: the dispatcher
reads a `Source`, the webhooks relay (jobs.events.relay) reads the history narrow,
the cursors (jobs.events.cursors) and the lag (jobs.events.lag) are kept per source,
and a body must come out byte for byte the same whichever sink sends it (D384).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from jobs.events import domain_event_body, signing

EVENT_COLUMNS = """e.id, e.job_id, e.at, e.from_status, e.to_status, e.lease_version, e.seq,
       j.client_id, j.task, j.queue, j.priority, j.status, j.payload, j.result, j.error,
       j.retry_count, j.max_retries, j.lease_version, j.idempotency_key, j.run_at,
       j.created_at, j.updated_at, j.finished_at, j.progress, j.cancel_requested_at,
       d.id, d.webhook_id, d.source_job_id, j.trace_context"""
EVENT_JOINS = """LEFT JOIN jobs_job j ON j.id = e.job_id
LEFT JOIN jobs_webhookdelivery d ON d.job_id = e.job_id"""
# The batch's history rows first, then their jobs and deliveries (D396): with the join
# under the LIMIT, the planner (on a freshly written range its statistics do not know)
# joined every row up to the horizon, a drain's 20,000, and kept 2,000: five times the
# read's cost, growing with the backlog.
RANGE_SQL = """
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
_EVENTS_SQL = RANGE_SQL.format(columns=EVENT_COLUMNS, joins=EVENT_JOINS)
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


# Where a whole row (EVENT_COLUMNS) has its job's trace context.
TRACE_COLUMN = 28


def _event(row: Sequence[Any]) -> OutboxEvent:
    event_id, job_id, to_status, seq, client_id = row[0], row[1], row[4], row[6], row[7]
    return OutboxEvent(
        event_id, job_id, client_id, signing.event_type(to_status), seq, to_status,
        signing.message_id(event_id), tuple(row[25:28]) if row[25] is not None else None, row,
        trace=row[TRACE_COLUMN],
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


HISTORY = Source("jobs_jobevent", "", _EVENTS_SQL, _event,
                 cursors_sql="c.name NOT LIKE '%%.domain'",
                 rows_sql="e.kind = 'transition'", binary=True)  # fmt: skip
DOMAIN = Source("jobs_domainevent", ".domain", _DOMAIN_EVENTS_SQL, _domain_event,
                cursors_sql="c.name LIKE '%%.domain'", rows_sql="true")  # fmt: skip
SOURCES = (HISTORY, DOMAIN)
