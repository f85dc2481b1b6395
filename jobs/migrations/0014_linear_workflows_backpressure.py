"""Workflow triggers linear in the edges they touch; webhook deliveries held by a full
queue (issue 28).

Replaces the function jobs_job_dependents only (CREATE OR REPLACE FUNCTION: no lock on
jobs_job, the trigger itself is untouched). The old one labelled every descendant
with every failed root (work of roots x descendants x edges in one statement) and
marked each settled edge (a write per edge); the new one walks each not-started job
once and writes no edge (D107). The history trigger's function gets a hash join for
its transition tables (ALTER FUNCTION ... SET: no lock on jobs_job, body untouched).
A partial index of the webhook deliveries still waiting for a job (built
CONCURRENTLY, so the migration is not atomic) serves the release of those a full
queue held back (D110). `jobs_jobdependency.settled` leaves the model but stays in
the table with its default, so code still inserting it keeps working until a later
release drops it.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models

# jobs.graph.dependents_function_sql() as of this migration (a test keeps them equal
# until the next migration replaces it).
DEPENDENTS = """
CREATE OR REPLACE FUNCTION jobs_job_dependents() RETURNS trigger LANGUAGE plpgsql AS $$
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
  SELECT array_agg(t.id), array_agg(t.id) FILTER (WHERE t.status = 'failed')
  INTO ended_now, failed_now FROM (
    SELECT id, status FROM jobs_job_dep_new WHERE status IN ('done', 'failed')
    EXCEPT
    SELECT id, status FROM jobs_job_dep_old WHERE status IN ('done', 'failed')) t;
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
                  AND (SELECT c.status FROM jobs_job c WHERE c.id = d.child_id) IN ('enqueue_failed', 'queued'))
    ORDER BY wn.key, wn.job_id
  LOOP
    WITH RECURSIVE reach(id) AS (
      SELECT root.id
      UNION
      SELECT s.child_id FROM reach x CROSS JOIN LATERAL (
        SELECT d.child_id FROM jobs_jobdependency d WHERE d.parent_id = x.id
          AND (SELECT c.status FROM jobs_job c WHERE c.id = d.child_id) IN ('enqueue_failed', 'queued')
        OFFSET 0) s
    )
    SELECT array_agg(id) INTO victims FROM reach WHERE id <> root.id;
    UPDATE jobs_job SET status = 'failed', error = 'dependency failed: ' || root.key,
           finished_at = statement_timestamp(), result = NULL, wait_reason = NULL,
           updated_by = 'api'
    WHERE id = ANY(victims) AND status IN ('enqueue_failed', 'queued');
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
  UPDATE jobs_job SET run_at = now(), due_at = now(), wait_reason = NULL,
         updated_by = 'api'
  WHERE id = ANY(woken)
    AND status = 'queued' AND wait_reason = 'parents';

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

# jobs.graph.history_plan_sql() as of this migration: only the function's settings
# change (ALTER FUNCTION), its body stays as 0013 installed it.
HISTORY_PLAN = """ALTER FUNCTION jobs_job_history_update() SET enable_nestloop = off;
"""
HISTORY_PLAN_RESET = "ALTER FUNCTION jobs_job_history_update() RESET enable_nestloop;\n"

# The function as 0012 installed it, frozen so that unapplying restores it.
PREVIOUS_DEPENDENTS = """
CREATE OR REPLACE FUNCTION jobs_job_dependents() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NOT EXISTS (
    SELECT 1 FROM jobs_job_dep_new n JOIN jobs_job_dep_old o ON o.id = n.id
    JOIN jobs_workflownode wn ON wn.job_id = n.id
    WHERE n.status IN ('done', 'failed') AND o.status <> n.status) THEN
    RETURN NULL;
  END IF;

  WITH RECURSIVE roots AS (
    SELECT n.id, wn.key FROM jobs_job_dep_new n JOIN jobs_job_dep_old o ON o.id = n.id
    JOIN jobs_workflownode wn ON wn.job_id = n.id
    JOIN jobs_workflow w ON w.id = wn.workflow_id
    WHERE n.status = 'failed' AND o.status <> 'failed'
      AND w.on_failure = 'fail_dependents'
  ), descendants(id, root) AS (
    SELECT d.child_id, r.key FROM jobs_jobdependency d JOIN roots r ON d.parent_id = r.id
    UNION
    SELECT d.child_id, x.root FROM jobs_jobdependency d JOIN descendants x ON d.parent_id = x.id
  ), victims AS (
    SELECT id, min(root) AS root FROM descendants GROUP BY id
  )
  UPDATE jobs_job j SET status = 'failed', error = 'dependency failed: ' || v.root,
         finished_at = statement_timestamp(), result = NULL, wait_reason = NULL,
         updated_by = 'api'
  FROM victims v
  WHERE j.id = v.id AND j.status IN ('queued', 'enqueue_failed');

  WITH ended AS (
    SELECT n.id FROM jobs_job_dep_new n JOIN jobs_job_dep_old o ON o.id = n.id
    WHERE n.status IN ('done', 'failed') AND o.status <> n.status
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
  UPDATE jobs_job j SET run_at = now(), due_at = now(), wait_reason = NULL,
         updated_by = 'api'
  FROM pending p
  WHERE j.id = p.job_id AND p.pending_parents = 0
    AND j.status = 'queued' AND j.wait_reason = 'parents';

  WITH ended AS (
    UPDATE jobs_workflownode wn SET ended = true
    FROM jobs_job_dep_new n JOIN jobs_job_dep_old o ON o.id = n.id
    WHERE wn.job_id = n.id AND n.status IN ('done', 'failed') AND o.status <> n.status
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
"""


class Migration(migrations.Migration):
    atomic = False  # the index is built CONCURRENTLY

    dependencies = [
        ("jobs", "0013_event_outbox"),
    ]

    operations = [
        migrations.RunSQL(DEPENDENTS, PREVIOUS_DEPENDENTS),
        migrations.RunSQL(HISTORY_PLAN, HISTORY_PLAN_RESET),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.RemoveField(model_name="jobdependency", name="settled")],
        ),
        AddIndexConcurrently(
            model_name="webhookdelivery",
            index=models.Index(
                condition=models.Q(("job__isnull", True)),
                fields=["webhook", "source_job_id", "seq", "id"],
                name="delivery_waiting_idx",
            ),
        ),
    ]
