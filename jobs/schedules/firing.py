"""Every write of the scheduler: a slot is claimed by inserting its scheduler_runs row
(ON CONFLICT DO NOTHING), and the job is inserted by the same statement only if that
insert won. Whatever the number of schedulers and whatever crashes between them, a
slot has one row and at most one job (none when overlap `skip` passed it over, or its
queue was past JOBS_MAX_QUEUE_DEPTH).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection, transaction

from jobs import lifecycle, metrics, services
from jobs.conf import settings
from jobs.lifecycle import NON_TERMINAL, Role, Status
from jobs.models import Client, Job, Schedule, SchedulerRun
from jobs.schedules.timing import InvalidTiming, Timing

log = logging.getLogger(__name__)

J = Job._meta.db_table
S = Schedule._meta.db_table
R = SchedulerRun._meta.db_table
SCHEDULER_ACTOR = lifecycle.actor(Role.REAPER, "scheduler")

# One due schedule, locked for this transaction; another scheduler skips it and takes
# the next. The lock is a courtesy (less contention): scheduler_runs' unique slot
# is what makes a slot fire once.
# A deactivated client's schedules wait (and catch up by their policy if it comes back).
_LIVE_OWNER = f"""(client_id IS NULL OR EXISTS (
  SELECT 1 FROM {Client._meta.db_table} c WHERE c.id = client_id AND c.is_active))"""
_LOCK_DUE_SQL = f"""
SELECT id, cron, interval_seconds, timezone, next_fire_at, catch_up, now()
FROM {S} WHERE enabled AND next_fire_at <= now() AND {_LIVE_OWNER}
ORDER BY next_fire_at LIMIT 1 FOR UPDATE SKIP LOCKED"""

# A slot whose queue is past JOBS_MAX_QUEUE_DEPTH is skipped like an overlap (D109):
# claimed with no job, counted as queue_full. The depth is the API's bounded count: past
# the limit, only jobs due within JOBS_QUEUE_DEPTH_HORIZON count (D198; CASE counts
# those only when the first count is over).
_FIRE_SQL = f"""
WITH s AS (
  SELECT sc.*, NOT %(manual)s AND CASE WHEN (
           SELECT count(*) FROM (SELECT 1 FROM {J} WHERE status = '{Status.QUEUED}'
                                 AND queue = sc.queue LIMIT %(limit)s + 1) AS bounded
         ) > %(limit)s THEN (
           SELECT count(*) FROM (SELECT 1 FROM {J} WHERE status = '{Status.QUEUED}'
                                 AND queue = sc.queue
                                 AND run_at <= now() + make_interval(secs => %(horizon)s)
                                 LIMIT %(limit)s + 1) AS bounded
         ) > %(limit)s ELSE false END AS queue_full
  FROM {S} sc WHERE sc.id = %(schedule)s
), run AS (
  INSERT INTO {R} (schedule_id, fire_time, job_id, manual, fired_by, created_at)
  SELECT s.id, %(fire_time)s,
         CASE WHEN s.queue_full THEN NULL
              WHEN s.overlap = '{Schedule.Overlap.SKIP}' AND NOT %(manual)s AND EXISTS (
                SELECT 1 FROM {J} j WHERE j.schedule_id = s.id
                  AND j.status IN ({lifecycle.sql_list(NON_TERMINAL)}))
              THEN NULL
              ELSE nextval(pg_get_serial_sequence('{J}', 'id')) END,
         %(manual)s, %(actor)s, now()
  FROM s
  ON CONFLICT (schedule_id, fire_time) DO NOTHING
  RETURNING job_id, fire_time
), job AS (
  INSERT INTO {J} (id, task, payload, queue, priority, run_at, max_retries, client_id,
                   updated_by, schedule_id, fire_time, timeout, status, retry_count,
                   lease_version, concurrency_key, trace_context)
  SELECT run.job_id, s.task, s.payload, s.queue, s.priority, now(),
         COALESCE(s.max_retries, %(default_retries)s), s.client_id, %(actor)s, s.id,
         run.fire_time, s.timeout, '{Status.QUEUED}', 0, 0, s.concurrency_key,
         s.trace_context
  FROM run, s WHERE run.job_id IS NOT NULL
  RETURNING id, queue, task, run_at <= now() AS due
)
SELECT run.job_id, job.queue, job.task, job.due,
       extract(epoch FROM clock_timestamp() - run.fire_time), s.queue_full
FROM run CROSS JOIN s LEFT JOIN job ON job.id = run.job_id"""

_IDLE_TIMEOUT_SQL = "SET LOCAL idle_in_transaction_session_timeout = '5s'"

_ADVANCE_SQL = f"""
UPDATE {S} SET next_fire_at = %(next)s,
       last_fire_at = greatest(last_fire_at, %(last)s)
WHERE id = %(schedule)s"""

_NEXT_DUE_SQL = f"""
SELECT extract(epoch FROM min(next_fire_at) - now()) FROM {S} WHERE enabled AND {_LIVE_OWNER}"""


@dataclass(frozen=True, slots=True)
class Fired:
    """A slot this scheduler claimed: its job, or None when overlap or a full queue
    skipped it."""

    schedule_id: int
    fire_time: datetime
    job_id: int | None
    lag: float


def _rows(sql: str, params: dict) -> list[tuple]:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall() if cur.description else []


def fire_slot(
    schedule_id: int, fire_time: datetime, *, actor: str = SCHEDULER_ACTOR, manual: bool = False
) -> Fired | None:
    """Claim one slot inside the caller's transaction; None if another scheduler has.

    The job's Redis push runs when that transaction commits (a failed push parks
    it as enqueue_failed, as for any submission).
    """
    rows = _rows(
        _FIRE_SQL,
        {
            "schedule": schedule_id,
            "fire_time": fire_time,
            "manual": manual,
            "actor": actor,
            "default_retries": settings.JOBS_MAX_RETRIES,
            "limit": settings.JOBS_MAX_QUEUE_DEPTH,
            "horizon": float(settings.JOBS_QUEUE_DEPTH_HORIZON),
        },
    )
    if not rows:
        return None
    job_id, queue, task, due, lag, queue_full = rows[0]
    if job_id is not None:
        transaction.on_commit(metrics.child(metrics.SUBMITTED, queue, task).inc)
        if due:
            services.signal_after_commit([(job_id, queue)], park_on_failure=True)
    outcome = (
        "enqueued" if job_id is not None else "queue_full" if queue_full else "overlap_skipped"
    )
    if queue_full:
        log.warning("schedule %d skipped the slot %s: its queue is full", schedule_id,
                    fire_time.isoformat(), extra={"schedule_id": schedule_id})  # fmt: skip
    transaction.on_commit(metrics.child(metrics.SCHEDULE_SLOTS, outcome).inc)
    if not manual:
        transaction.on_commit(lambda: metrics.SCHEDULE_LAG.observe(float(lag)))
    return Fired(schedule_id, fire_time, job_id, float(lag))


def lock_next_due() -> tuple | None:
    """Lock the earliest due schedule no other scheduler holds, for the caller's
    transaction: (id, cron, interval_seconds, timezone, next_fire_at, catch_up, now).

    A frozen scheduler (SIGSTOP, a stalled VM) must not hold that lock or a
    half-inserted slot for long: PostgreSQL ends its transaction after 5 s idle.
    """
    _rows(_IDLE_TIMEOUT_SQL, {})
    rows = _rows(_LOCK_DUE_SQL, {})
    return rows[0] if rows else None


def fire_next_due(catch_up_max: int | None = None) -> list[Fired] | None:
    """Fire the due slots of one due schedule in one durable transaction and move its
    next_fire_at past now. None when no schedule is due (or every due one is locked
    by another scheduler)."""
    keep_all = catch_up_max if catch_up_max is not None else settings.JOBS_SCHEDULE_CATCH_UP_MAX
    with transaction.atomic(durable=True):
        due = lock_next_due()
        if due is None:
            return None
        schedule_id, cron, interval, zone, next_fire_at, catch_up, now = due
        timing = Timing(cron, interval, zone)
        keep = keep_all if catch_up == Schedule.CatchUp.ALL else 1
        try:
            slots, following = timing.due(next_fire_at, now, keep)
        except InvalidTiming:
            # Checked when written, so only a zone the tz database dropped gets here:
            # look again in a minute rather than hold up every schedule due after it.
            log.exception("schedule %d cannot compute its slots", schedule_id)
            slots, following = [], now + timedelta(seconds=60)
        fired = [f for f in (fire_slot(schedule_id, t) for t in slots) if f is not None]
        _rows(
            _ADVANCE_SQL,
            {"schedule": schedule_id, "next": following, "last": slots[-1] if slots else None},
        )
    for f in fired:
        log.info(
            "schedule %d fired for %s",
            f.schedule_id,
            f.fire_time.isoformat(),
            extra={"job_id": f.job_id, "schedule_id": f.schedule_id, "lag": round(f.lag, 3)},
        )
    return fired


def seconds_until_next_due() -> float | None:
    """How long until the earliest enabled schedule is due (negative: overdue)."""
    rows = _rows(_NEXT_DUE_SQL, {})
    return float(rows[0][0]) if rows and rows[0][0] is not None else None


def run_now(schedule_id: int, actor: str) -> Fired | None:
    """A slot at the database's now, made by staff: a job whatever the overlap policy,
    recorded in scheduler_runs as manual. Inside the caller's transaction."""
    with connection.cursor() as cur:
        cur.execute("SELECT clock_timestamp()")
        (now,) = cur.fetchone()
    return fire_slot(schedule_id, now, actor=actor, manual=True)
