"""The webhooks relay: the outbox's subscriber that fans each event out to the deliveries
of the webhooks that take it (issue 16, D262), run by its own dispatcher thread.

Its own room: what it reads (the history narrow, whole rows only for the events a
webhook takes) and what it writes around the one statement of jobs.events.fanout
(which webhooks a client has, the chains a full webhooks queue held back) are the
webhooks' concern, not the dispatcher's loop, which hands it a batch like any sink.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from django.db import connection, transaction

from jobs import admission, metrics, services
from jobs.conf import settings
from jobs.events import fanout, signing
from jobs.events.reads import binary_rows
from jobs.events.sources import (
    EVENT_COLUMNS,
    EVENT_JOINS,
    HISTORY,
    RANGE_SQL,
    TRACE_COLUMN,
    OutboxEvent,
)
from jobs.lifecycle import TERMINAL, sql_list

# What the webhooks fan-out needs of every event: whose job it is and whether the job is
# a delivery. The whole row (the body) is read for the events a webhook takes only.
_FANOUT_EVENTS_SQL = RANGE_SQL.format(
    columns="e.id, e.job_id, e.to_status, e.seq, j.client_id, d.id, d.webhook_id, d.source_job_id",
    joins=EVENT_JOINS,
)
_EVENTS_BY_ID_SQL = f"""
SELECT {EVENT_COLUMNS}
FROM jobs_jobevent e
{EVENT_JOINS}
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
            event = missing[row[0]]
            event.row, event.trace = row, row[TRACE_COLUMN]


# The history as the webhooks fan-out reads it: the same events, narrow rows (D262).
FANOUT_HISTORY = replace(HISTORY, events_sql=_FANOUT_EVENTS_SQL, event=_fanout_event,
                         narrow=True, wide=HISTORY)  # fmt: skip


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
        rows = [(hook_id, e.id, e.job_id, e.seq or 0, e.type, e.body, e.trace)
                for hook_id, e in taken]  # fmt: skip
        chains = {(r[0], r[2]) for r in rows}
        # A chain is released by its delivery job's end: the job's other events (queued,
        # processing, a retry) leave it busy, and checking them cost the fan-out
        # statement two thirds of its chains (issue 41).
        chains |= {(e.delivery[1], e.delivery[2]) for e in events
                   if e.delivery is not None and e.to_status in TERMINAL}  # fmt: skip
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
