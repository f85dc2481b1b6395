"""Progress of running jobs and cancel requests for them (issue 22).

Two nullable columns without a default (no table rewrite on a large jobs_job):
`progress`, written by the worker's fenced heartbeat, and `cancel_requested_at`,
set when a client or staff member cancels a processing job. The guard trigger,
reinstalled here, clears `progress` on a claim and ends a job with a pending cancel
request as failed "cancelled" when any path would put it back to queued, and a
check constraint says a waiting job never carries a pending request. It is added NOT
VALID (no scan under the ACCESS EXCLUSIVE lock) and validated in its own statement,
which scans under a lock that lets reads and writes go on.
"""

from django.db import migrations, models

from jobs.lifecycle import guard_trigger_sql

# The trigger as 0007 installed it, frozen here so that unapplying restores it.
PREVIOUS_TRIGGER = """
CREATE OR REPLACE FUNCTION jobs_job_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF NEW.status <> 'queued' OR NEW.lease_version <> 0 THEN
      RAISE EXCEPTION 'illegal job insert: status % lease_version %', NEW.status, NEW.lease_version
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_insert';
    END IF;
    NEW.due_at := greatest(NEW.created_at, NEW.run_at);
    RETURN NEW;
  END IF;
  IF TG_OP = 'DELETE' THEN
    IF OLD.status NOT IN ('done', 'failed') THEN
      RAISE EXCEPTION 'illegal job delete: job % is %', OLD.id, OLD.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_delete_terminal_only';
    END IF;
    RETURN OLD;
  END IF;
  IF NEW.lease_version < OLD.lease_version THEN
    RAISE EXCEPTION 'illegal lease_version decrease on job %: % -> %',
      OLD.id, OLD.lease_version, NEW.lease_version
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_monotonic';
  END IF;
  IF NEW.status <> OLD.status THEN
    IF (OLD.status || '>' || NEW.status) NOT IN ('enqueue_failed>failed', 'enqueue_failed>queued', 'failed>queued', 'processing>done', 'processing>failed', 'processing>queued', 'queued>enqueue_failed', 'queued>failed', 'queued>processing') THEN
      RAISE EXCEPTION 'illegal job transition on job %: % -> %', OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_transition';
    END IF;
    IF (OLD.status || '>' || NEW.status) IN ('processing>queued', 'queued>processing')
       AND NEW.lease_version <= OLD.lease_version THEN
      RAISE EXCEPTION 'job % changed hands (% -> %) without a lease bump',
        OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
    END IF;
    IF NEW.status = 'processing' THEN
      -- A new attempt starts without the last one's error detail.
      NEW.error_class := NULL;
      NEW.error_traceback := NULL;
    END IF;
  ELSIF NEW.status = 'processing'
        AND NEW.owned_by IS NOT NULL AND NEW.owned_by IS DISTINCT FROM OLD.owned_by
        AND NEW.lease_version <= OLD.lease_version THEN
    RAISE EXCEPTION 'job % changed owner without a lease bump', OLD.id
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
  END IF;
  NEW.updated_at := statement_timestamp();
  RETURN NEW;
END
$$;

-- History, one statement per write: the rows a statement changed are read from its
-- transition tables, so a batch of N transitions costs one INSERT, not N trigger calls.
CREATE OR REPLACE FUNCTION jobs_job_history_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO jobs_jobevent
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error)
  SELECT n.id, statement_timestamp(), NULL, n.status, COALESCE(n.updated_by, ''), n.lease_version,
         n.retry_count, CASE WHEN n.status = 'done' THEN NULL ELSE n.error END
  FROM jobs_job_new n;
  RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION jobs_job_history_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO jobs_jobevent
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error,
     error_class, error_traceback)
  SELECT n.id, statement_timestamp(), o.status, n.status, COALESCE(n.updated_by, ''),
         n.lease_version, n.retry_count,
         CASE WHEN n.status = 'done' THEN NULL ELSE n.error END,
         CASE WHEN o.status = 'processing' THEN n.error_class END,
         CASE WHEN o.status = 'processing' THEN n.error_traceback END
  FROM jobs_job_new n JOIN jobs_job_old o ON o.id = n.id
  WHERE n.status <> o.status;
  RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS jobs_job_guard ON jobs_job;
CREATE TRIGGER jobs_job_guard BEFORE INSERT OR UPDATE OR DELETE ON jobs_job
  FOR EACH ROW EXECUTE FUNCTION jobs_job_guard();
DROP TRIGGER IF EXISTS jobs_job_history ON jobs_job;
DROP FUNCTION IF EXISTS jobs_job_history();
DROP TRIGGER IF EXISTS jobs_job_history_insert ON jobs_job;
CREATE TRIGGER jobs_job_history_insert AFTER INSERT ON jobs_job
  REFERENCING NEW TABLE AS jobs_job_new
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_history_insert();
DROP TRIGGER IF EXISTS jobs_job_history_update ON jobs_job;
CREATE TRIGGER jobs_job_history_update AFTER UPDATE ON jobs_job
  REFERENCING OLD TABLE AS jobs_job_old NEW TABLE AS jobs_job_new
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_history_update();
"""


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0008_worker_registry"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="progress",
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="cancel_requested_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AlterModelOptions(
            name="job",
            options={
                "permissions": [
                    ("retry_job", "Can retry failed jobs (resets the retry budget)"),
                    ("repair_job", "Can repair enqueue_failed jobs"),
                    ("revoke_job", "Can revoke the lease of processing jobs"),
                    ("cancel_job", "Can cancel jobs that have not started"),
                    ("cancel_running_job", "Can ask running jobs to stop (cancel running)"),
                ]
            },
        ),
        migrations.RunSQL(
            guard_trigger_sql("jobs_job", "jobs_jobevent"), reverse_sql=PREVIOUS_TRIGGER
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddConstraint(
                    model_name="job",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("status__in", ["queued", "enqueue_failed"]), _negated=True),
                            ("cancel_requested_at__isnull", True),
                            _connector="OR",
                        ),
                        name="job_waiting_has_no_cancel_request",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    "ALTER TABLE jobs_job ADD CONSTRAINT job_waiting_has_no_cancel_request "
                    "CHECK (status NOT IN ('queued', 'enqueue_failed') "
                    "OR cancel_requested_at IS NULL) NOT VALID",
                    reverse_sql="ALTER TABLE jobs_job "
                    "DROP CONSTRAINT job_waiting_has_no_cancel_request",
                ),
                migrations.RunSQL(
                    "ALTER TABLE jobs_job VALIDATE CONSTRAINT job_waiting_has_no_cancel_request",
                    reverse_sql=migrations.RunSQL.noop,
                ),
            ],
        ),
    ]
