"""Sequences and batches (issue 46, jobs.flow): two nullable columns on jobs_job (no
rewrite, no default to fill), four small tables of their own, and the triggers of
jobs.flow.triggers, installed frozen. The triggers are created only if missing and
their functions replaced in place: no exclusive lock on a live jobs_job beyond the
brief one CREATE TRIGGER takes. No index on jobs_job: a sequence's waiting jobs and a
batch's failures are found through their own tables."""

import django.contrib.postgres.fields
import django.db.models.deletion
import django.db.models.functions.datetime
from django.db import migrations, models

from jobs.migrations._triggers import DROP_FLOW_TRIGGERS_0027, FLOW_TRIGGERS_0027


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0026_job_trace_context"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="batch_id",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="sequence_key",
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
        migrations.AlterField(
            model_name="job",
            name="wait_reason",
            field=models.CharField(
                blank=True,
                choices=[
                    ("sleep", "Sleep"),
                    ("signal", "Signal"),
                    ("parents", "Parents"),
                    ("sequence", "Sequence"),
                    ("sequence_halted", "Sequence Halted"),
                ],
                max_length=20,
                null=True,
            ),
        ),
        migrations.CreateModel(
            name="Batch",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("name", models.CharField(blank=True, default="", max_length=200)),
                ("total", models.IntegerField(default=0)),
                (
                    "pending",
                    models.IntegerField(default=0, help_text="Jobs that have not ended yet."),
                ),
                ("succeeded", models.IntegerField(default=0)),
                ("failed", models.IntegerField(default=0)),
                (
                    "callbacks",
                    models.JSONField(
                        default=dict,
                        help_text="on_complete / on_success / on_failure: the job each makes.",
                    ),
                ),
                (
                    "callback_job_ids",
                    django.contrib.postgres.fields.ArrayField(
                        base_field=models.BigIntegerField(), blank=True, null=True, size=None
                    ),
                ),
                ("idempotency_key", models.CharField(blank=True, max_length=200, null=True)),
                ("request_hash", models.CharField(blank=True, max_length=64, null=True)),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                (
                    "client",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="batches",
                        to="jobs.client",
                    ),
                ),
            ],
            options={
                "db_table": "jobs_batch",
                "ordering": ["-id"],
            },
        ),
        migrations.CreateModel(
            name="BatchFailure",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("job_id", models.BigIntegerField()),
                (
                    "batch",
                    models.ForeignKey(
                        db_constraint=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="failures",
                        to="jobs.batch",
                    ),
                ),
            ],
            options={
                "db_table": "jobs_batchfailure",
            },
        ),
        migrations.CreateModel(
            name="Sequence",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                (
                    "owner",
                    models.IntegerField(help_text="The client's id; 0 for the project's own jobs."),
                ),
                ("key", models.CharField(max_length=200)),
                (
                    "active_job_id",
                    models.BigIntegerField(
                        blank=True,
                        help_text="The job whose turn it is (queued or processing).",
                        null=True,
                    ),
                ),
                (
                    "halted_job_id",
                    models.BigIntegerField(
                        blank=True, help_text="The failed job that halted the sequence.", null=True
                    ),
                ),
                ("halted_at", models.DateTimeField(blank=True, null=True)),
                ("last_position", models.BigIntegerField(db_default=0, default=0)),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                (
                    "updated_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "db_table": "jobs_sequence",
                "ordering": ["owner", "key"],
                "constraints": [
                    models.UniqueConstraint(fields=("owner", "key"), name="sequence_owner_key_uniq")
                ],
            },
        ),
        migrations.CreateModel(
            name="SequenceWait",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("position", models.BigIntegerField()),
                ("job_id", models.BigIntegerField()),
                (
                    "sequence",
                    models.ForeignKey(
                        db_constraint=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="waits",
                        to="jobs.sequence",
                    ),
                ),
            ],
            options={
                "db_table": "jobs_sequencewait",
                "ordering": ["sequence_id", "position"],
            },
        ),
        migrations.AddIndex(
            model_name="batch",
            index=models.Index(
                condition=models.Q(("finished_at__isnull", True)),
                fields=["id"],
                name="batch_running_idx",
            ),
        ),
        migrations.AddConstraint(
            model_name="batch",
            constraint=models.UniqueConstraint(
                condition=models.Q(("idempotency_key__isnull", False)),
                fields=("client", "idempotency_key"),
                name="batch_idempotency_key_per_client",
                nulls_distinct=False,
            ),
        ),
        migrations.AddConstraint(
            model_name="batchfailure",
            constraint=models.UniqueConstraint(
                fields=("batch", "job_id"), name="batchfailure_uniq"
            ),
        ),
        migrations.AddConstraint(
            model_name="sequencewait",
            constraint=models.UniqueConstraint(
                fields=("sequence", "position"), name="sequencewait_position_uniq"
            ),
        ),
        migrations.RunSQL(FLOW_TRIGGERS_0027, DROP_FLOW_TRIGGERS_0027),
    ]
