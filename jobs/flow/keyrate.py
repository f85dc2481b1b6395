"""Rates per concurrency key, counted in PostgreSQL (jobs_keyhit).

A queue's `key_rate` throttles: at most N starts of one key in any window of its
period, the others wait queued. A submission's `rate_limit` drops: past N accepted
submissions of the key in the window, the next is refused (429 with Retry-After).
Each counted event is a row written in the transaction of the claim or submission it
counts, under a lock every counter of the key takes (the queue row's lock for starts,
a transaction advisory lock for submissions): a rollback uncounts it, a crash leaves
only what committed, and no interleaving of processes exceeds the limit. Redis plays
no part. Rows older than their window are pruned by the next counter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import connection

from jobs import lifecycle
from jobs.models import Job, KeyHit

START = "start"  # a queue's key_rate: claims
SUBMIT = "submit"  # a submission's rate_limit: accepted submissions
KH = KeyHit._meta.db_table
T = Job._meta.db_table

_WINDOW_SQL = f"""
SELECT client_key, key, count(*), min(at), statement_timestamp() FROM {KH}
WHERE scope = %(scope)s AND queue = %(queue)s
  AND at > statement_timestamp() - make_interval(secs => %(period)s){{one}}
GROUP BY 1, 2"""
_ONE_KEY = " AND client_key = %(client)s AND key = %(key)s"
# Submissions prune their own key only: two submissions of different keys never wait
# on each other's rows.
_PRUNE_SQL = f"""
DELETE FROM {KH} WHERE scope = %(scope)s AND queue = %(queue)s
  AND at <= statement_timestamp() - make_interval(secs => %(period)s){{one}}"""
_RECORD_STARTS_SQL = f"""
INSERT INTO {KH} (scope, queue, client_key, key, at)
SELECT '{START}', queue, COALESCE(client_id, 0), concurrency_key, %(at)s FROM {T}
WHERE id = ANY(%(ids)s) AND concurrency_key IS NOT NULL AND {lifecycle.hot_sql()}"""
_RECORD_ONE_SQL = f"""
INSERT INTO {KH} (scope, queue, client_key, key, at)
VALUES ('{SUBMIT}', %(queue)s, %(client)s, %(key)s, statement_timestamp())"""

# The keyed claim's rows a key's rate still allows (services.claims.turns._KEYED): the
# n-th row of a key in the batch is taken only while n is within what the window leaves
# the key.
# Keys with no start in the window are absent from the arrays and have the whole limit.
PICK_SQL = """
    AND (%(key_rate)s::int IS NULL OR nth <= COALESCE((
      SELECT r.n FROM unnest(%(rate_clients)s::bigint[], %(rate_keys)s::text[],
                             %(rate_left)s::int[]) r(k, key, n)
      WHERE r.k = keyed.k AND r.key = keyed.key), %(key_rate)s::int))"""
NO_RATE = {"key_rate": None, "rate_clients": [], "rate_keys": [], "rate_left": []}


@dataclass
class Window:
    """The keys with events in the window: what each has left, and for the keys at the
    limit when their oldest event leaves it (their next token)."""

    limit: int
    left: dict[tuple[int, str], int] = field(default_factory=dict)
    due: dict[tuple[int, str], float] = field(default_factory=dict)  # seconds from now

    @property
    def full(self) -> set[tuple[int, str]]:
        return {k for k, n in self.left.items() if n <= 0}

    def params(self) -> dict[str, object]:
        """The claim's PICK_SQL parameters."""
        partial = [(k, n) for k, n in self.left.items() if n > 0]
        return {
            "key_rate": self.limit,
            "rate_clients": [k[0] for k, _ in partial],
            "rate_keys": [k[1] for k, _ in partial],
            "rate_left": [n for _, n in partial],
        }

    def next_due(self) -> float | None:
        """Seconds until the first full key may start again; None when none is full."""
        return min(self.due.values(), default=None)


def _window(
    scope: str, queue: str, limit: int, period: int, one: tuple[int, str] | None = None
) -> Window:
    params = {"scope": scope, "queue": queue, "period": period}
    sql = _WINDOW_SQL.replace("{one}", "")
    if one is not None:
        sql = _WINDOW_SQL.replace("{one}", _ONE_KEY)
        params |= {"client": one[0], "key": one[1]}
    win = Window(limit)
    with connection.cursor() as cur:
        cur.execute(sql, params)
        for client_key, key, count, oldest, now in cur.fetchall():
            win.left[(client_key, key)] = limit - count
            if count >= limit:
                leaves: datetime = oldest + timedelta(seconds=period)
                win.due[(client_key, key)] = max((leaves - now).total_seconds(), 0.001)
    return win


def start_window(queue: str, limit: int, period: int) -> Window:
    """The starts of each key in the queue's window, pruning older ones. Call under the
    queue row's lock (services.claim_limited_under_queue_lock)."""
    with connection.cursor() as cur:
        cur.execute(
            _PRUNE_SQL.replace("{one}", ""), {"scope": START, "queue": queue, "period": period}
        )
    return _window(START, queue, limit, period)


def record_starts(job_ids: Sequence[int], at: datetime) -> None:
    """Count the claimed jobs that carry a key, at the claim's statement time (the
    history's `at`), in the claim's transaction."""
    if job_ids:
        with connection.cursor() as cur:
            cur.execute(_RECORD_STARTS_SQL, {"ids": list(job_ids), "at": at})


def submission_retry_after(
    queue: str, client_key: int, key: str, limit: int, period: int
) -> int | None:
    """Seconds (whole, at least 1) until one more submission of the key fits its
    window; None when it fits now. Call under the key's lock (`lock_key`)."""
    with connection.cursor() as cur:
        cur.execute(
            _PRUNE_SQL.replace("{one}", _ONE_KEY),
            {"scope": SUBMIT, "queue": queue, "period": period, "client": client_key, "key": key},
        )
    win = _window(SUBMIT, queue, limit, period, (client_key, key))
    due = win.next_due()
    return None if due is None else max(1, math.ceil(due))


def record_submission(queue: str, client_key: int, key: str) -> None:
    with connection.cursor() as cur:
        cur.execute(_RECORD_ONE_SQL, {"queue": queue, "client": client_key, "key": key})


def lock_key(kind: str, queue: str, client_key: int, key: str) -> None:
    """Serialise, until the transaction ends, every submission of this key that counts
    or looks at it: an advisory lock on a hash of (kind, queue, client, key)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 46))",
            [f"{kind}\x1f{queue}\x1f{client_key}\x1f{key}"],
        )
