"""The database side of durable waits and workflows: triggers on jobs_job.

Generated from `jobs.lifecycle` like the guard, installed by migration 0012. They
add to the guard and the history triggers; they replace neither.

- `jobs_job_wait_clear` (BEFORE UPDATE, per row, only when a waiting row is
  claimed): a claimed job waits for nothing any more, so its wait_reason and
  wait_key go.
- `jobs_job_dependents` (AFTER UPDATE, once per statement): when a workflow job
  ends (done or failed) in a statement, in the same statement and transaction
  1. under on_failure=fail_dependents, a failed job fails every descendant that
     has not started, with error "dependency failed: <step id>";
  2. each edge from an ended parent is settled once, and the child's count of
     pending parents goes down by the edges settled (row locks serialise
     concurrent parents, so the last one always sees zero: no lost wake-up);
  3. a child whose count reached zero is made due now (run_at, due_at);
  4. the workflow's count of unfinished jobs goes down; at zero it is finished.
  Every path that ends a job (the worker's fenced writes, the reaper, a cancel,
  the fail-dependents update itself) runs through it.
"""

from __future__ import annotations

from jobs.lifecycle import TERMINAL, Role, Status, WaitReason, sql_list

T = "jobs_job"


def triggers_sql() -> str:
    return f"""
CREATE OR REPLACE FUNCTION {T}_wait_clear() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  NEW.wait_reason := NULL;
  NEW.wait_key := NULL;
  RETURN NEW;
END
$$;
DROP TRIGGER IF EXISTS {T}_wait_clear ON {T};
CREATE TRIGGER {T}_wait_clear BEFORE UPDATE ON {T} FOR EACH ROW
  WHEN (OLD.wait_reason IS NOT NULL AND NEW.status = '{Status.PROCESSING}'
        AND OLD.status <> '{Status.PROCESSING}')
  EXECUTE FUNCTION {T}_wait_clear();

CREATE OR REPLACE FUNCTION {T}_dependents() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NOT EXISTS (
    SELECT 1 FROM {T}_dep_new n JOIN {T}_dep_old o ON o.id = n.id
    JOIN jobs_workflownode wn ON wn.job_id = n.id
    WHERE n.status IN ({sql_list(TERMINAL)}) AND o.status <> n.status) THEN
    RETURN NULL;
  END IF;

  WITH RECURSIVE roots AS (
    SELECT n.id, wn.key FROM {T}_dep_new n JOIN {T}_dep_old o ON o.id = n.id
    JOIN jobs_workflownode wn ON wn.job_id = n.id
    JOIN jobs_workflow w ON w.id = wn.workflow_id
    WHERE n.status = '{Status.FAILED}' AND o.status <> '{Status.FAILED}'
      AND w.on_failure = 'fail_dependents'
  ), descendants(id, root) AS (
    SELECT d.child_id, r.key FROM jobs_jobdependency d JOIN roots r ON d.parent_id = r.id
    UNION
    SELECT d.child_id, x.root FROM jobs_jobdependency d JOIN descendants x ON d.parent_id = x.id
  ), victims AS (
    SELECT id, min(root) AS root FROM descendants GROUP BY id
  )
  UPDATE {T} j SET status = '{Status.FAILED}', error = 'dependency failed: ' || v.root,
         finished_at = statement_timestamp(), result = NULL, wait_reason = NULL,
         updated_by = '{Role.API}'
  FROM victims v
  WHERE j.id = v.id AND j.status IN ('{Status.QUEUED}', '{Status.ENQUEUE_FAILED}');

  WITH ended AS (
    SELECT n.id FROM {T}_dep_new n JOIN {T}_dep_old o ON o.id = n.id
    WHERE n.status IN ({sql_list(TERMINAL)}) AND o.status <> n.status
  ), settled AS (
    UPDATE jobs_jobdependency d SET settled = true
    WHERE d.parent_id IN (SELECT id FROM ended) AND NOT d.settled
    RETURNING d.child_id
  ), counted AS (
    SELECT child_id, count(*) AS k FROM settled GROUP BY child_id
  ), pending AS (
    UPDATE jobs_workflownode wn SET pending_parents = greatest(wn.pending_parents - c.k, 0)
    FROM counted c WHERE wn.job_id = c.child_id
    RETURNING wn.job_id, wn.pending_parents
  )
  UPDATE {T} j SET run_at = now(), due_at = now(), wait_reason = NULL,
         updated_by = '{Role.API}'
  FROM pending p
  WHERE j.id = p.job_id AND p.pending_parents = 0
    AND j.status = '{Status.QUEUED}' AND j.wait_reason = '{WaitReason.PARENTS}';

  WITH ended AS (
    UPDATE jobs_workflownode wn SET ended = true
    FROM {T}_dep_new n JOIN {T}_dep_old o ON o.id = n.id
    WHERE wn.job_id = n.id AND n.status IN ({sql_list(TERMINAL)}) AND o.status <> n.status
      AND NOT wn.ended
    RETURNING wn.workflow_id
  ), counted AS (
    SELECT workflow_id, count(*) AS k FROM ended GROUP BY workflow_id
  )
  UPDATE jobs_workflow w SET unfinished = greatest(w.unfinished - c.k, 0),
         finished_at = CASE WHEN w.unfinished - c.k <= 0 THEN statement_timestamp()
                            ELSE w.finished_at END
  FROM counted c WHERE w.id = c.workflow_id;
  RETURN NULL;
END
$$;
DROP TRIGGER IF EXISTS {T}_dependents ON {T};
CREATE TRIGGER {T}_dependents AFTER UPDATE ON {T}
  REFERENCING OLD TABLE AS {T}_dep_old NEW TABLE AS {T}_dep_new
  FOR EACH STATEMENT EXECUTE FUNCTION {T}_dependents();
"""


def drop_triggers_sql() -> str:
    return f"""
DROP TRIGGER IF EXISTS {T}_dependents ON {T};
DROP FUNCTION IF EXISTS {T}_dependents();
DROP TRIGGER IF EXISTS {T}_wait_clear ON {T};
DROP FUNCTION IF EXISTS {T}_wait_clear();
"""
