"""Each failed attempt keeps its exception: class, message and a bounded traceback;
each job keeps when it became due, where the SLO clock starts.

Nullable columns without a default (no table rewrite on a large jobs_job). The
worker's fenced fail writes `error_class` / `error_traceback` on the job row in
the same statement as `error`; the per-statement history trigger, reinstalled
here, copies them into the event of the change that ended the attempt and stamps
history with the statement's clock. `due_at` is set by the insert trigger; rows
older than it stay NULL and count from created_at.
"""

from django.db import migrations, models

from jobs.lifecycle import guard_trigger_sql

# The trigger as 0006 installed it, frozen here so that unapplying restores it.
PREVIOUS_TRIGGER = """
CREATE OR REPLACE FUNCTION jobs_job_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF NEW.status <> 'queued' OR NEW.lease_version <> 0 THEN
      RAISE EXCEPTION 'illegal job insert: status % lease_version %', NEW.status, NEW.lease_version
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_insert';
    END IF;
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
  ELSIF NEW.status = 'processing'
        AND NEW.owned_by IS NOT NULL AND NEW.owned_by IS DISTINCT FROM OLD.owned_by
        AND NEW.lease_version <= OLD.lease_version THEN
    RAISE EXCEPTION 'job % changed owner without a lease bump', OLD.id
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
  END IF;
  NEW.updated_at := now();
  RETURN NEW;
END
$$;

-- History, one statement per write: the rows a statement changed are read from its
-- transition tables, so a batch of N transitions costs one INSERT, not N trigger calls.
CREATE OR REPLACE FUNCTION jobs_job_history_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO jobs_jobevent
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error)
  SELECT n.id, now(), NULL, n.status, COALESCE(n.updated_by, ''), n.lease_version,
         n.retry_count, CASE WHEN n.status = 'done' THEN NULL ELSE n.error END
  FROM jobs_job_new n;
  RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION jobs_job_history_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO jobs_jobevent
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error)
  SELECT n.id, now(), o.status, n.status, COALESCE(n.updated_by, ''), n.lease_version,
         n.retry_count, CASE WHEN n.status = 'done' THEN NULL ELSE n.error END
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
    dependencies = [("jobs", "0006_history_per_statement")]

    operations = [
        migrations.AddField(
            model_name="job",
            name="error_class",
            field=models.CharField(
                blank=True,
                help_text="Import path, e.g. builtins.ValueError.",
                max_length=200,
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="job",
            name="error_traceback",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="jobevent",
            name="error_class",
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
        migrations.AddField(
            model_name="jobevent",
            name="error_traceback",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="due_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunSQL(
            guard_trigger_sql("jobs_job", "jobs_jobevent"), reverse_sql=PREVIOUS_TRIGGER
        ),
    ]
