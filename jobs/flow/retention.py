"""Retention of the per-key bookkeeping rows no live job needs (the reaper's pass, D361).

A debounce key's row outlives its job (one row per key ever used), so does a sequence
key's row, and the rate rows of a key no submission looks at again stay past their
window. Each delete is one short statement that leaves alone what a submission may be
about to use:

- jobs_debounce: a row whose named job is not live (ended, or gone), not locked by a
  submission (SKIP LOCKED) and not (re)named in the last `grace` seconds, so a
  submission that named a job after this statement's snapshot is never undone. A
  submission that made sure of the row just before it went makes sure again
  (jobs.flow.debounce).
- jobs_sequence: a key not halted, with no waiting job, whose active job is not live,
  untouched for `grace`. Every submission of the key and every end of its active job
  writes the row (updated_at) under its lock; a submission after the delete upserts a
  fresh row, which is then the key's whole state.
- jobs_keyhit: rows older than the longest period a window may have (a day): no window
  counts them, whatever the limit or period a later submission or claim brings.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connection, transaction

from jobs import lifecycle, queues
from jobs.lifecycle import NON_TERMINAL
from jobs.models import Debounce, Job, KeyHit, Sequence, SequenceWait

T, D, KH = Job._meta.db_table, Debounce._meta.db_table, KeyHit._meta.db_table
S, SW = Sequence._meta.db_table, SequenceWait._meta.db_table
_LIVE = lifecycle.sql_list(NON_TERMINAL)
GRACE = 3600.0  # seconds a row is kept after its last use

_DEBOUNCE_SQL = f"""
DELETE FROM {D} WHERE id IN (
  SELECT d.id FROM {D} d
  WHERE (d.first_at IS NULL OR d.first_at < now() - make_interval(secs => %(grace)s))
    AND NOT EXISTS (SELECT 1 FROM {T} j WHERE j.id = d.job_id
                    AND j.status IN ({_LIVE}) AND {lifecycle.hot_sql("j")})
  LIMIT %(batch)s FOR UPDATE SKIP LOCKED)"""
_SEQUENCE_SQL = f"""
DELETE FROM {S} WHERE id IN (
  SELECT s.id FROM {S} s
  WHERE s.halted_job_id IS NULL
    AND s.updated_at < now() - make_interval(secs => %(grace)s)
    AND NOT EXISTS (SELECT 1 FROM {SW} w WHERE w.sequence_id = s.id)
    AND NOT EXISTS (SELECT 1 FROM {T} j WHERE j.id = s.active_job_id
                    AND j.status IN ({_LIVE}) AND {lifecycle.hot_sql("j")})
  LIMIT %(batch)s FOR UPDATE SKIP LOCKED)"""
_KEYHIT_SQL = f"""
DELETE FROM {KH} WHERE id IN (
  SELECT id FROM {KH} WHERE at < statement_timestamp() - make_interval(secs => %(period)s)
  LIMIT %(batch)s)"""


@dataclass
class Pruned:
    debounce: int = 0
    sequence: int = 0
    keyhit: int = 0

    @property
    def total(self) -> int:
        return self.debounce + self.sequence + self.keyhit


def _one(sql: str, params: dict[str, float | int]) -> int:
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.rowcount


def prune(grace: float = GRACE, batch: int = 500) -> Pruned:
    """Delete, `batch` rows a statement, the bookkeeping rows no live job needs."""
    out = Pruned()
    steps = (
        ("debounce", _DEBOUNCE_SQL, {"grace": grace}),
        ("sequence", _SEQUENCE_SQL, {"grace": grace}),
        ("keyhit", _KEYHIT_SQL, {"period": queues.KEY_RATE_PERIOD_MAX}),
    )
    for name, sql, params in steps:
        while True:
            n = _one(sql, {**params, "batch": batch})
            setattr(out, name, getattr(out, name) + n)
            if n < batch:
                break
    return out
