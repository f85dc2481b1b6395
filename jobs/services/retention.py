"""Row-wise retention: finished jobs past their age are deleted from the hot partition
in batches, their history with them. A cold period goes whole, by partition
(jobs.archive.retention), once every job of it is finished and moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from jobs.lifecycle import TERMINAL
from jobs.models import JobEvent
from jobs.services.common import HOT, _rows, moved_retry

_H = JobEvent._meta.db_table


# Row-wise retention reads the hot partition (HOT) only: a cold period goes whole, by
# partition (jobs.archive.retention), once every job of it is finished and moved.

_PRUNE_SQL = f"""
WITH victims AS (
  SELECT id FROM {HOT}
  WHERE status = ANY(%(statuses)s)
    AND finished_at < now() - %(age)s * interval '1 second'
  LIMIT %(batch)s
  FOR UPDATE SKIP LOCKED),
ev AS (DELETE FROM {_H} WHERE job_id IN (SELECT id FROM victims)),
steps AS (DELETE FROM jobs_jobstep WHERE job_id IN (SELECT id FROM victims)),
sigs AS (DELETE FROM jobs_jobsignal WHERE job_id IN (SELECT id FROM victims)),
nodes AS (DELETE FROM jobs_workflownode WHERE job_id IN (SELECT id FROM victims)),
edges AS (DELETE FROM jobs_jobdependency
          WHERE child_id IN (SELECT id FROM victims) OR parent_id IN (SELECT id FROM victims)),
-- A webhook delivery goes with its delivery job (jobs.events): its status was the job's.
dl AS (DELETE FROM jobs_webhookdelivery WHERE job_id IN (SELECT id FROM victims)),
gone AS (DELETE FROM {HOT} WHERE id IN (SELECT id FROM victims) RETURNING 1)
SELECT count(*) FROM gone"""


def prune_finished(older_than_seconds: float, statuses: Sequence[str], batch: int) -> int:
    """Delete one batch of terminal jobs still in jobs_job_hot and finished more than
    `older_than_seconds` ago (database clock), with their history, steps, signals and
    workflow links; returns how many jobs went.

    One short statement: rows another transaction holds are skipped (SKIP LOCKED),
    so workers, the reaper and a concurrent prune never wait on it. Only terminal
    statuses are accepted, and the table's trigger refuses to delete any other row.
    """
    bad = sorted(set(statuses) - TERMINAL)
    if bad or not statuses:
        raise ValueError(f"only terminal jobs can be pruned, not {', '.join(bad) or 'nothing'}")
    if older_than_seconds <= 0 or batch <= 0:
        raise ValueError("older_than_seconds and batch must be positive")
    params = {"statuses": sorted(set(statuses)), "age": older_than_seconds, "batch": batch}
    return moved_retry(partial(_rows, _PRUNE_SQL, params))[0][0]
