"""Completion events and the outbox (issue 16).

Two nullable columns without a default (no table rewrite of jobs_job or
jobs_jobevent): `jobs_job.event_seq`, kept by the guard trigger, and
`jobs_jobevent.seq`, copied from it by the history triggers, so every event
carries a per-job sequence number at no extra read. Replaces the functions
jobs_job_guard, jobs_job_history_insert and jobs_job_history_update. The new
tables are empty: their indexes are built inline.
"""

import django.contrib.postgres.fields
import django.db.models.deletion
import django.db.models.functions.datetime
from django.db import migrations, models

from jobs.lifecycle import guard_trigger_sql

# The trigger as 0009 installed it (0010-0012 left it alone), frozen here so that unapplying restores it.
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
  IF OLD.status = 'processing' AND NEW.status = 'queued'
     AND NEW.cancel_requested_at IS NOT NULL THEN
    NEW.status := 'failed';
    NEW.error := 'cancelled';
    NEW.finished_at := statement_timestamp();
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
      -- A new attempt starts without the last one's error detail or progress.
      NEW.error_class := NULL;
      NEW.error_traceback := NULL;
      NEW.progress := NULL;
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
        ("jobs", "0012_steps_workflows"),
    ]

    operations = [
        migrations.CreateModel(
            name="DomainEvent",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("type", models.CharField(max_length=200)),
                ("payload", models.JSONField(default=dict)),
                ("at", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                "db_table": "jobs_domainevent",
                "ordering": ["id"],
            },
        ),
        migrations.CreateModel(
            name="OutboxCursor",
            fields=[
                ("name", models.CharField(max_length=50, primary_key=True, serialize=False)),
                ("last_id", models.BigIntegerField(default=0)),
                ("horizon_id", models.BigIntegerField(blank=True, null=True)),
                ("horizon_snapshot", models.TextField(blank=True, null=True)),
                (
                    "updated_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "db_table": "jobs_outboxcursor",
            },
        ),
        migrations.AddField(
            model_name="job",
            name="event_seq",
            field=models.IntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="jobevent",
            name="seq",
            field=models.IntegerField(blank=True, null=True),
        ),
        migrations.CreateModel(
            name="Webhook",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("url", models.URLField(max_length=2000)),
                (
                    "events",
                    django.contrib.postgres.fields.ArrayField(
                        base_field=models.CharField(max_length=40), size=None
                    ),
                ),
                ("enabled", models.BooleanField(default=True)),
                ("secret_salt", models.CharField(max_length=64)),
                ("disabled_reason", models.CharField(blank=True, default="", max_length=200)),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                (
                    "updated_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                (
                    "client",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="webhooks",
                        to="jobs.client",
                    ),
                ),
            ],
            options={
                "db_table": "jobs_webhook",
                "ordering": ["id"],
            },
        ),
        migrations.CreateModel(
            name="WebhookDelivery",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                (
                    "event_id",
                    models.BigIntegerField(help_text="The jobs_jobevent row (the message id)."),
                ),
                ("source_job_id", models.BigIntegerField()),
                ("seq", models.IntegerField()),
                ("type", models.CharField(max_length=40)),
                ("body", models.TextField(help_text="The signed JSON, the same on every attempt.")),
                ("attempts", models.IntegerField(default=0)),
                ("last_status_code", models.IntegerField(blank=True, null=True)),
                ("last_error", models.CharField(blank=True, default="", max_length=500)),
                ("last_attempt_at", models.DateTimeField(blank=True, null=True)),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                (
                    "job",
                    models.OneToOneField(
                        blank=True,
                        db_constraint=False,
                        null=True,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="webhook_delivery",
                        to="jobs.job",
                    ),
                ),
                (
                    "webhook",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="deliveries",
                        to="jobs.webhook",
                    ),
                ),
            ],
            options={
                "verbose_name_plural": "webhook deliveries",
                "db_table": "jobs_webhookdelivery",
                "ordering": ["-id"],
                "permissions": [
                    ("redeliver_webhookdelivery", "Can redeliver failed webhook deliveries")
                ],
            },
        ),
        migrations.AddIndex(
            model_name="webhook",
            index=models.Index(fields=["client", "id"], name="webhook_client_idx"),
        ),
        migrations.AddConstraint(
            model_name="webhook",
            constraint=models.CheckConstraint(
                condition=models.Q(("events", []), _negated=True), name="webhook_has_events"
            ),
        ),
        migrations.AddIndex(
            model_name="webhookdelivery",
            index=models.Index(
                fields=["webhook", "source_job_id", "seq"], name="delivery_chain_idx"
            ),
        ),
        migrations.AddConstraint(
            model_name="webhookdelivery",
            constraint=models.UniqueConstraint(
                fields=("webhook", "event_id"), name="delivery_once_per_event"
            ),
        ),
        migrations.RunSQL(
            guard_trigger_sql("jobs_job", "jobs_jobevent"), reverse_sql=PREVIOUS_TRIGGER
        ),
    ]
