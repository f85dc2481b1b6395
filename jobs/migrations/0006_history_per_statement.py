"""History rows written once per statement (transition tables) instead of once per row.

A batched claim or completion of N jobs fires one INSERT into jobs_jobevent instead
of N trigger calls; the history itself is unchanged (one row per status change, same
columns, same actor). Reinstalls the SQL that jobs.lifecycle generates today.
"""

from django.db import migrations

from jobs.lifecycle import guard_trigger_sql

PREVIOUS_HISTORY = """
DROP TRIGGER IF EXISTS jobs_job_history_insert ON jobs_job;
DROP TRIGGER IF EXISTS jobs_job_history_update ON jobs_job;
DROP FUNCTION IF EXISTS jobs_job_history_insert();
DROP FUNCTION IF EXISTS jobs_job_history_update();
CREATE OR REPLACE FUNCTION jobs_job_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' OR NEW.status <> OLD.status THEN
    INSERT INTO jobs_jobevent
      (job_id, at, from_status, to_status, actor, lease_version, retry_count, error)
    VALUES (NEW.id, now(), CASE WHEN TG_OP = 'INSERT' THEN NULL ELSE OLD.status END,
            NEW.status, COALESCE(NEW.updated_by, ''), NEW.lease_version, NEW.retry_count,
            CASE WHEN NEW.status = 'done' THEN NULL ELSE NEW.error END);
  END IF;
  RETURN NULL;
END
$$;
CREATE TRIGGER jobs_job_history AFTER INSERT OR UPDATE ON jobs_job
  FOR EACH ROW EXECUTE FUNCTION jobs_job_history();
"""


class Migration(migrations.Migration):
    dependencies = [("jobs", "0005_processing_index_on_id")]

    operations = [
        migrations.RunSQL(
            guard_trigger_sql("jobs_job", "jobs_jobevent"), reverse_sql=PREVIOUS_HISTORY
        ),
    ]
