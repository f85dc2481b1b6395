"""The database side of durable waits and workflows: triggers on jobs_job.

Generated from `jobs.lifecycle` like the guard; installed by migration 0012, the
dependents function replaced by 0016 (each migration installs its text frozen in
jobs/migrations/_triggers.py; tests/test_migrations_frozen.py holds the newest one
equal to this module). They add to the guard and the
history triggers; they replace neither.

- `jobs_job_wait_clear` (BEFORE UPDATE, per row, only when a waiting row is
  claimed): a claimed job waits for nothing any more, so its wait_reason and
  wait_key go.
- `jobs_job_dependents` (AFTER UPDATE, once per statement): when a workflow job
  ends (done or failed) in a statement, in the same statement and transaction
  1. under on_failure=fail_dependents, a failed job fails every descendant that
     has not started, with error "dependency failed: <step id>" (the smallest id
     among the steps failed by the statement that reach it);
  2. the first end of a job flips its node's `ended` flag, and each child that has
     not ended has its count of pending parents go down by its edges from the jobs
     that flipped (row locks serialise concurrent parents, so the last one always
     sees zero: no lost wake-up);
  3. a child whose count reached zero is made due now (run_at, due_at);
  4. the workflow's count of unfinished jobs goes down; at zero it is finished.
  Every path that ends a job (the worker's fenced writes, the reaper, a cancel,
  the fail-dependents update itself) runs through it.

Linear in the edges touched (D107): the failure walk goes only through jobs that have
not started, each job is failed once (a later root finds it failed and stops), and
no edge row is written: the parent's `ended` flag is what makes its edges count once.
"""

from __future__ import annotations

from jobs.lifecycle import TERMINAL, Role, Status, WaitReason, sql_list

T = "jobs_job"
_NOT_STARTED = f"'{Status.ENQUEUE_FAILED}', '{Status.QUEUED}'"


def _create_trigger_once(name: str, definition: str) -> str:
    """Create the trigger only if it is missing: its definition has not changed since
    0012, and a DROP/CREATE on a live jobs_job would wait for an exclusive lock."""
    return f"""DO $do$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = '{T}'::regclass
                 AND tgname = '{name}') THEN
    {definition};
  END IF;
END $do$;
"""


def wait_clear_sql() -> str:
    return f"""
CREATE OR REPLACE FUNCTION {T}_wait_clear() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  NEW.wait_reason := NULL;
  NEW.wait_key := NULL;
  RETURN NEW;
END
$$;
""" + _create_trigger_once(
        f"{T}_wait_clear",
        f"""CREATE TRIGGER {T}_wait_clear BEFORE UPDATE ON {T} FOR EACH ROW
      WHEN (OLD.wait_reason IS NOT NULL AND NEW.status = '{Status.PROCESSING}'
            AND OLD.status <> '{Status.PROCESSING}')
      EXECUTE FUNCTION {T}_wait_clear()""",
    )


def dependents_function_sql() -> str:
    """The statement trigger's function. Roots are taken in step-id order, so a job two
    roots reach is failed (and named) by the smaller id and the other stops at it.

    Plans are pinned where a bad estimate would cost more than the work: the ended
    rows come from an EXCEPT of the transition tables (a join of the two is
    estimated at one row and run as a nested loop, rows x rows), edges are looked up
    per parent (LATERAL ... OFFSET 0 keeps the lookup on the parent index), and jobs,
    nodes and workflows by their keys (scalar subqueries, id arrays)."""
    return f"""
CREATE OR REPLACE FUNCTION {T}_dependents() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  root record;
  ended_now bigint[];
  failed_now bigint[];
  victims bigint[];
  ended_ids bigint[];
  ended_workflows bigint[];
  children bigint[];
  settled int[];
  woken bigint[];
BEGIN
  SELECT array_agg(t.id), array_agg(t.id) FILTER (WHERE t.status = '{Status.FAILED}')
  INTO ended_now, failed_now FROM (
    SELECT id, status FROM {T}_dep_new WHERE status IN ({sql_list(TERMINAL)})
    EXCEPT
    SELECT id, status FROM {T}_dep_old WHERE status IN ({sql_list(TERMINAL)})) t;
  IF ended_now IS NULL
     OR NOT EXISTS (SELECT 1 FROM jobs_workflownode WHERE job_id = ANY(ended_now)) THEN
    RETURN NULL;
  END IF;

  FOR root IN
    SELECT wn.job_id AS id, wn.key FROM jobs_workflownode wn
    WHERE wn.job_id = ANY(failed_now)
      AND (SELECT w.on_failure FROM jobs_workflow w WHERE w.id = wn.workflow_id)
          = 'fail_dependents'
      AND EXISTS (SELECT 1 FROM jobs_jobdependency d WHERE d.parent_id = wn.job_id
                  AND (SELECT c.status FROM {T} c WHERE c.id = d.child_id) IN ({_NOT_STARTED}))
    ORDER BY wn.key, wn.job_id
  LOOP
    WITH RECURSIVE reach(id) AS (
      SELECT root.id
      UNION
      SELECT s.child_id FROM reach x CROSS JOIN LATERAL (
        SELECT d.child_id FROM jobs_jobdependency d WHERE d.parent_id = x.id
          AND (SELECT c.status FROM {T} c WHERE c.id = d.child_id) IN ({_NOT_STARTED})
        OFFSET 0) s
    )
    SELECT array_agg(id) INTO victims FROM reach WHERE id <> root.id;
    UPDATE {T} SET status = '{Status.FAILED}', error = 'dependency failed: ' || root.key,
           finished_at = statement_timestamp(), result = NULL, wait_reason = NULL,
           updated_by = '{Role.API}'
    WHERE id = ANY(victims) AND status IN ({_NOT_STARTED});
  END LOOP;

  WITH ended AS (
    UPDATE jobs_workflownode SET ended = true WHERE job_id = ANY(ended_now) AND NOT ended
    RETURNING job_id, workflow_id
  )
  SELECT array_agg(job_id), array_agg(workflow_id) INTO ended_ids, ended_workflows FROM ended;
  IF ended_ids IS NULL THEN
    RETURN NULL;
  END IF;

  SELECT array_agg(s.child_id), array_agg(s.k) INTO children, settled FROM (
    SELECT e.child_id, count(*)::int AS k FROM unnest(ended_ids) AS p(id)
    CROSS JOIN LATERAL (
      SELECT d.child_id FROM jobs_jobdependency d WHERE d.parent_id = p.id OFFSET 0) e
    GROUP BY e.child_id) s;
  WITH pending AS (
    UPDATE jobs_workflownode wn SET pending_parents = greatest(wn.pending_parents - u.k, 0)
    FROM unnest(children, settled) AS u(id, k)
    WHERE wn.job_id = u.id AND NOT wn.ended
    RETURNING wn.job_id, wn.pending_parents
  )
  SELECT array_agg(job_id) INTO woken FROM pending WHERE pending_parents = 0;
  UPDATE {T} SET run_at = now(), due_at = now(), wait_reason = NULL,
         updated_by = '{Role.API}'
  WHERE id = ANY(woken)
    AND status = '{Status.QUEUED}' AND wait_reason = '{WaitReason.PARENTS}';

  WITH counted AS (
    SELECT e.id, count(*) AS k FROM unnest(ended_workflows) AS e(id) GROUP BY e.id
  )
  UPDATE jobs_workflow w SET unfinished = greatest(w.unfinished - c.k, 0),
         finished_at = CASE WHEN w.unfinished - c.k <= 0 THEN statement_timestamp()
                            ELSE w.finished_at END
  FROM counted c WHERE w.id = c.id;
  RETURN NULL;
END
$$;
"""


def history_plan_sql() -> str:
    """The history trigger joins its two transition tables, which the planner guesses at
    one row each: a 1,000-row statement (a workflow cancelled, its descendants failed)
    then compares 1,000,000 pairs. A hash join is right at every size."""
    return f"ALTER FUNCTION {T}_history_update() SET enable_nestloop = off;\n"


def triggers_sql() -> str:
    """Both triggers and their functions; on a database that has the triggers already,
    only the functions are replaced (no lock on jobs_job)."""
    return (
        wait_clear_sql()
        + dependents_function_sql()
        + _create_trigger_once(
            f"{T}_dependents",
            f"""CREATE TRIGGER {T}_dependents AFTER UPDATE ON {T}
      REFERENCING OLD TABLE AS {T}_dep_old NEW TABLE AS {T}_dep_new
      FOR EACH STATEMENT EXECUTE FUNCTION {T}_dependents()""",
        )
    )


def drop_triggers_sql() -> str:
    return f"""
DROP TRIGGER IF EXISTS {T}_dependents ON {T};
DROP FUNCTION IF EXISTS {T}_dependents();
DROP TRIGGER IF EXISTS {T}_wait_clear ON {T};
DROP FUNCTION IF EXISTS {T}_wait_clear();
"""
