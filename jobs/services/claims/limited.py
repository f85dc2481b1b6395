"""The claim of a queue with controls (a concurrency cap, a rate, a key cap, a pause),
under the queue row's lock (FOR UPDATE): every claim of the queue is serialised, so the
processing rows and the window of starts it counts stay counted until it commits. It
asks claims.turns for a fair or keyed queue and the plain statement otherwise, and says
when the queue is worth asking again (`Gated.blocked_for`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction

from jobs.lifecycle import Status
from jobs.services.claims.plain import QT, _claim_queue_sql, _leases, claim_next
from jobs.services.claims.turns import (
    _TURN_CLIENT,
    CAP_RECHECK_SECONDS,
    _claim_in_turns_under_queue_lock,
)
from jobs.services.common import Lease, T, _hot_rows, _rows

# The same claim under the queue's row lock, with the limit its controls allow.
_CLAIM_LIMITED_SQL = _claim_queue_sql()


_QUEUE_LOCK_SQL = (
    "SELECT paused, concurrency, rate_limit, rate_period, fair, key_concurrency,"
    f" key_rate_limit, key_rate_period FROM {QT} WHERE name = %s FOR UPDATE"
)
_QUEUE_STATE_SQL = f"""
SELECT statement_timestamp(), rate_starts,
       CASE WHEN concurrency IS NULL THEN 0 ELSE (
         SELECT count(*) FROM {T} WHERE status = '{Status.PROCESSING}' AND queue = %(queue)s)
       END
FROM {QT} WHERE name = %(queue)s"""
_QUEUE_STARTS_SQL = f"UPDATE {QT} SET rate_starts = %s WHERE name = %s"
# The limited claim also returns its statement_timestamp(): the history's `at`.
_CLAIM_LIMITED_SQL = _CLAIM_LIMITED_SQL.replace(
    "timeout\nFROM u", "timeout, statement_timestamp()\nFROM u"
)
assert "timeout, statement_timestamp()\nFROM u" in _CLAIM_LIMITED_SQL


@dataclass(frozen=True, slots=True)
class Gated:
    """What a claim of a limited queue got, and whether its controls cut it short.

    `blocked_for` is None when the controls allowed every job asked for, else the
    seconds until a slot or a token may be due: CAP_RECHECK_SECONDS for a cap, the
    exact time for a rate, inf when paused (until someone resumes it).
    """

    leases: list[Lease]
    blocked_for: float | None = None
    last_client: int = 0  # a fair queue: the client whose turn came last


def claim_limited_under_queue_lock(
    worker_id: str, queue: str, limit: int, after: int = 0, *, start: int | None = None
) -> Gated:
    """queued → processing for up to `limit` due jobs of a queue with controls, never
    more than its concurrency cap processing at once nor more than its rate's starts
    in any window of its period, however many workers claim at once.

    Under the queue row's lock (FOR UPDATE), the processing rows and the window of
    starts are read at a statement_timestamp() later than every start recorded (each
    holder committed before this one locked), and each start is recorded with its claim
    statement's statement_timestamp(), the history's `at`. So for any window of the
    period, the last claim to start a job in it counted every earlier start in it.
    A `key_concurrency` caps the jobs of each concurrency key the same way (counted
    under the same lock); a fair queue's claim takes turns between clients from the
    one after `after`. Hazard: every claim of the queue waits for the lock, so keep
    this transaction short.
    """
    with transaction.atomic(durable=True):
        rows = _rows(_QUEUE_LOCK_SQL, [queue])
        if not rows:  # no controls row (not synced yet): an open queue
            return Gated(claim_next(worker_id, [queue], limit, start=start))
        paused, cap, rate, period, fair, key_cap, key_rate, key_period = rows[0]
        if paused:
            return Gated([], float("inf"))
        now, starts, running = _rows(_QUEUE_STATE_SQL, {"queue": queue})[0]
        allowed, blocked_for = limit, None
        if cap is not None and cap - running < allowed:
            allowed, blocked_for = max(0, cap - running), CAP_RECHECK_SECONDS
        window: list[datetime] = []
        if rate is not None:
            since = now - timedelta(seconds=period)
            window = sorted((s for s in starts if s > since), reverse=True)
            if rate - len(window) < allowed:
                allowed = max(0, rate - len(window))
                # After this claim, the rate-th newest start is the first to leave.
                first_out = window[rate - allowed - 1] if rate > allowed else now
                due = (first_out + timedelta(seconds=period) - now).total_seconds()
                blocked_for = max(blocked_for or 0.0, due, 0.001)
        if allowed <= 0:
            return Gated([], blocked_for)
        last_client = after
        if fair or key_cap is not None or key_rate is not None:
            rows, keys_wait = _claim_in_turns_under_queue_lock(
                worker_id, queue, allowed, fair=fair, key_cap=key_cap, after=after,
                start=start, key_rate=None if key_rate is None else (key_rate, key_period),
            )  # fmt: skip
            if keys_wait is not None:
                blocked_for = max(blocked_for or 0.0, keys_wait)
            last_client = rows[-1][_TURN_CLIENT] if fair and rows else after
        else:
            rows = _hot_rows(
                _CLAIM_LIMITED_SQL,
                {"queue": queue, "limit": allowed, "worker": worker_id,
                 "start": start},
            )  # fmt: skip
        if rate is not None and rows:
            _rows(_QUEUE_STARTS_SQL, [[r[-1] for r in rows] + window, queue])
        return Gated(_leases(rows, worker_id), blocked_for, last_client)
