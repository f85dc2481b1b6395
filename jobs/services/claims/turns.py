"""The claim in turns: a fair queue's clients take turns, and a keyed queue caps the
jobs of each concurrency key (docs/queue-controls.md). An open fair queue is claimed
here without a lock (`claim_fair`); a keyed or limited one through claims.limited, under
the queue row's lock, which counts the processing rows per key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import transaction

from jobs import lifecycle
from jobs.flow import keyrate
from jobs.lifecycle import NOT_STARTED, Status
from jobs.services.claims.plain import _LIMITED, CLAIMER, QT, _leases
from jobs.services.common import Lease, T, _hot_rows, _rows

# A fair queue's claim takes turns between clients: a loose index scan of
# job_fair_claim_idx visits up to `limit` clients with queued rows, starting after the
# client the worker served last and wrapping round, and takes each one's best rows
# (priority DESC, run_at, id) in rounds: every visited client's first row, then every
# second row. Each step is an index probe, so the cost grows with the clients visited,
# never with the backlog. NULL client_id (jobs from code) is one client, key 0.
_CK = "COALESCE(client_id, 0)"
_QUEUED_IN_QUEUE = f"{lifecycle.CLAIM.where()} AND queue = %(queue)s"


def _next_client_sql(op: str, bound: str) -> str:
    return (
        f"SELECT {_CK} FROM {T} WHERE {_QUEUED_IN_QUEUE} AND {_CK} {op} {bound} "
        f"ORDER BY queue, {_CK} LIMIT 1"
    )


def _fair_candidates_sql(also: str) -> str:
    """CTE `c(id, k, ord, key)`: the rows a fair claim takes, `ord` its turn order."""
    return f"""
RECURSIVE
after AS (
  SELECT ({_next_client_sql(">", "%(after)s::bigint")}) AS k, 1 AS i
  UNION ALL
  SELECT ({_next_client_sql(">", "a.k")}), a.i + 1 FROM after a
  WHERE a.k IS NOT NULL AND a.i < %(limit)s
), wrapped AS (
  SELECT ({_next_client_sql(">", "-1")}) AS k, 1 AS i
  UNION ALL
  SELECT ({_next_client_sql(">", "w.k")}), w.i + 1 FROM wrapped w
  WHERE w.k IS NOT NULL AND w.k < %(after)s::bigint AND w.i < %(limit)s
), visited AS (
  SELECT k, row_number() OVER (ORDER BY turn, k) AS turn FROM (
    SELECT k, 0 AS turn FROM after WHERE k IS NOT NULL
    UNION
    SELECT k, 1 FROM wrapped WHERE k IS NOT NULL AND k <= %(after)s::bigint
  ) v ORDER BY turn, k LIMIT %(limit)s
), share AS (SELECT ceil(%(limit)s::numeric / greatest(count(*), 1))::int AS n FROM visited),
rows_ AS (
  SELECT r.id, v.k, v.turn, r.key,
         row_number() OVER (PARTITION BY v.k ORDER BY r.ord) AS round
  FROM visited v, share, LATERAL (
    SELECT id, key, row_number() OVER (ORDER BY priority DESC, run_at, id) AS ord FROM (
      SELECT id, priority, run_at, concurrency_key AS key FROM {T}
      WHERE {_QUEUED_IN_QUEUE} AND {_CK} = v.k AND run_at <= now(){also}
      ORDER BY queue, {_CK}, priority DESC, run_at, id
      LIMIT share.n
      FOR UPDATE SKIP LOCKED
    ) s
  ) r
), c AS (
  SELECT id, k, row_number() OVER (ORDER BY round, turn) AS ord, key FROM rows_
  ORDER BY round, turn LIMIT %(limit)s
)"""


def _plain_candidates_sql(also: str) -> str:
    """CTE `c(id, k, ord, key)` in the plain claim order (a keyed queue that is not fair)."""
    return f"""
p AS (
  SELECT id, client_id, priority, run_at, concurrency_key FROM {T}
  WHERE {_QUEUED_IN_QUEUE} AND run_at <= now(){also}
  ORDER BY priority DESC, run_at, id
  LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED
), c AS (
  SELECT id, COALESCE(client_id, 0) AS k,
         row_number() OVER (ORDER BY priority DESC, run_at, id) AS ord, concurrency_key AS key
  FROM p
)"""


# A keyed queue: rows of keys already at their cap (the `full` arrays) are skipped by
# the scan; within the batch, a key's rows beyond what its cap leaves are dropped.
_NOT_FULL = """
    AND (concurrency_key IS NULL OR NOT EXISTS (
      SELECT FROM unnest(%(full_clients)s::bigint[], %(full_keys)s::text[]) f(k, key)
      WHERE f.k = COALESCE(client_id, 0) AND f.key = concurrency_key))"""
_KEYED = f"""
, keyed AS (
  SELECT id, k, ord, key, row_number() OVER (PARTITION BY k, key ORDER BY ord) AS nth
  FROM c
), picked AS (
  SELECT id, k, ord FROM keyed
  WHERE key IS NULL OR ((%(key_cap)s::int IS NULL OR nth + (
    SELECT count(*) FROM {T} x
    WHERE x.status = '{Status.PROCESSING}' AND x.queue = %(queue)s
      AND x.concurrency_key = keyed.key
      AND x.client_id IS NOT DISTINCT FROM nullif(keyed.k, 0)
  ) <= %(key_cap)s::int){keyrate.PICK_SQL})
)"""


def _claim_turns_sql(*, fair: bool, keyed: bool, also: str = "") -> str:
    """The claim of a fair and/or keyed queue. Returns the usual lease columns, then
    the client key (the worker's next `after`) and statement_timestamp() (the start
    a rate records), in turn order; the first `start` (all when NULL) are marked
    started (D77)."""
    filters = also + (_NOT_FULL if keyed else "")
    head = _fair_candidates_sql(filters) if fair else _plain_candidates_sql(filters)
    chosen = "picked" if keyed else "c"
    return f"""
WITH {head}{_KEYED if keyed else ""}
, u AS (
UPDATE {T} j SET status = '{Status.PROCESSING}', lease_version = j.lease_version + 1,
       owned_by = %(worker)s, claimed_at = now(), heartbeat_at = now(),
       started_at = CASE WHEN j.id = ANY(ARRAY(
                      SELECT id FROM {chosen} ORDER BY ord LIMIT %(start)s))
                    THEN statement_timestamp() END,
       updated_by = {CLAIMER}
WHERE j.id = ANY(ARRAY(SELECT id FROM {chosen})) AND {lifecycle.hot_sql("j")}
RETURNING j.id, j.lease_version, j.task, j.payload, j.queue, j.retry_count,
          j.max_retries, j.created_at, j.priority,
          coalesce(j.error LIKE '%%{NOT_STARTED}', false) AS rerun, j.timeout
)
SELECT u.id, lease_version, task, payload, queue, retry_count, max_retries, created_at,
       priority, rerun, timeout, t.k, statement_timestamp()
FROM u JOIN {chosen} t ON t.id = u.id ORDER BY t.ord
"""


# An open fair queue (no cap, rate or key cap): no lock, like the plain claim. A queue
# whose row says otherwise is claimed by the other claims only.
_FAIR_OPEN = (
    f"\n      AND NOT EXISTS (SELECT FROM {QT} q WHERE q.name = %(queue)s"
    f" AND (q.paused OR NOT q.fair OR {_LIMITED}))"
)
_CLAIM_FAIR_OPEN_SQL = _claim_turns_sql(fair=True, keyed=False, also=_FAIR_OPEN)
_CLAIM_TURNS_SQL = {
    (fair, keyed): _claim_turns_sql(fair=fair, keyed=keyed)
    for fair in (False, True)
    for keyed in (False, True)
}


_TURN_CLIENT = 11  # the client key's column in a turns claim's rows
# The turns claim costs milliseconds to plan, and PostgreSQL's plan cache kept planning
# it anew each time (its custom plans looked cheaper than the generic one), which made
# a fair drain tens of percent slower; the generic plan uses the same indexes.
_GENERIC_PLAN_SQL = "SET LOCAL plan_cache_mode = force_generic_plan"


@dataclass(frozen=True, slots=True)
class Turns:
    """What a fair claim got, and the client whose turn came last (the next `after`)."""

    leases: list[Lease]
    last_client: int


def claim_fair(
    worker_id: str, queue: str, limit: int, after: int = 0, *, start: int | None = None
) -> Turns:
    """queued → processing for up to `limit` due jobs of an open fair queue, clients
    taking turns from the one after `after`; never a paused, capped or keyed queue.
    The first `start` (all when None) are marked started (D77)."""
    with transaction.atomic(durable=True):
        _rows(_GENERIC_PLAN_SQL, [])
        rows = _hot_rows(
            _CLAIM_FAIR_OPEN_SQL,
            {"queue": queue, "limit": limit, "after": after, "worker": worker_id,
             "start": start},
        )  # fmt: skip
    return Turns(_leases(rows, worker_id), rows[-1][_TURN_CLIENT] if rows else after)


_KEYS_FULL_SQL = f"""
SELECT COALESCE(client_id, 0), concurrency_key, count(*) FROM {T}
WHERE status = '{Status.PROCESSING}' AND queue = %(queue)s AND concurrency_key IS NOT NULL
GROUP BY 1, 2 HAVING count(*) >= %(key_cap)s"""
KEYED_ROUNDS = 8  # each round claims at least one job or finds none left
CAP_RECHECK_SECONDS = 0.2  # when a slot frees is not known: how soon to look again


def _claim_in_turns_under_queue_lock(
    worker_id: str,
    queue: str,
    allowed: int,
    *,
    fair: bool,
    key_cap: int | None,
    after: int,
    start: int | None,
    key_rate: tuple[int, int] | None = None,
) -> tuple[list[tuple], float | None]:
    """The claim of a fair or keyed queue, inside claim_limited_under_queue_lock's
    transaction. Returns the rows and, when keys at their cap or rate held jobs back,
    the seconds until one may start again (else None).

    Under the queue's lock no other claim of the queue runs, so the processing rows
    and starts (jobs.flow.keyrate) counted per key stay counted until this
    transaction commits. A batch that keys at their cap or rate cut short is claimed
    again, the full keys skipped, so the jobs of other keys behind a full key's
    backlog still start.
    """
    sql = _CLAIM_TURNS_SQL[(fair, key_cap is not None or key_rate is not None)]
    _rows(_GENERIC_PLAN_SQL, [])
    params: dict[str, Any] = {
        "queue": queue, "after": after, "worker": worker_id,
        "key_cap": key_cap, "start": start,
        **keyrate.NO_RATE,
    }  # fmt: skip
    if key_cap is None and key_rate is None:
        return _hot_rows(sql, {**params, "limit": allowed}), None

    def keys_full() -> tuple[set[tuple[int, str]], keyrate.Window | None]:
        capped = {(r[0], r[1]) for r in _rows(_KEYS_FULL_SQL, params)} if key_cap else set()
        window = None if key_rate is None else keyrate.start_window(queue, *key_rate)
        return capped, window

    capped, window = keys_full()
    full = capped | (window.full if window is not None else set())
    out: list[tuple] = []
    for _ in range(KEYED_ROUNDS):
        want = allowed - len(out)
        if want <= 0:
            break
        rows = _hot_rows(
            sql,
            {**params, "limit": want, "full_clients": [k for k, _ in full],
             "full_keys": [key for _, key in full],
             "start": None if start is None else max(0, start - len(out)),
             **(window.params() if window is not None else {})},
        )  # fmt: skip
        if window is not None and rows:
            keyrate.record_starts([r[0] for r in rows], rows[-1][-1])
        out += rows
        if len(rows) == want:
            break
        # Fewer than asked: either no due row is left, or keys reached their cap or rate.
        capped, window = keys_full()
        now_full = capped | (window.full if window is not None else set())
        if now_full <= full or not rows:
            full = now_full
            break
        full = now_full
    if not full or len(out) >= allowed:
        return out, None
    waits = [CAP_RECHECK_SECONDS] if capped else []
    due = window.next_due() if window is not None else None
    return out, min([*waits, *([due] if due is not None else [])], default=CAP_RECHECK_SECONDS)


# The queue's row lock serialises every claim of a limited queue (and its pause). The
# statements after it begin once the previous holder committed: they read its claims.
