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

from jobs.migrations._triggers import GUARD_0009, GUARD_0013


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
        migrations.RunSQL(GUARD_0013, reverse_sql=GUARD_0009),
    ]
