"""Schedules, scheduler_runs and unique jobs (issue 15).

Safe on a live, large jobs_job: three nullable columns without a default (no
rewrite); `schedule_id` has no database foreign key (adding one validates every row
under lock; D57); the three new indexes on jobs_job, the unique partial index of
`unique_key` among them, are built CONCURRENTLY, so the migration is non-atomic.
A build that fails leaves an INVALID index: drop it and migrate again.
"""

import django.db.models.deletion
import django.db.models.functions.datetime
from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models

UNIQUE_KEY_INDEX = """
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS job_unique_key_live
ON jobs_job (client_id, unique_key) NULLS NOT DISTINCT
WHERE unique_key IS NOT NULL AND status IN ('enqueue_failed', 'processing', 'queued')
"""


class Migration(migrations.Migration):
    atomic = False
    dependencies = [
        ("jobs", "0010_queue_controls"),
    ]

    operations = [
        migrations.CreateModel(
            name="SchedulerRun",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("fire_time", models.DateTimeField()),
                ("job_id", models.BigIntegerField(blank=True, null=True)),
                ("manual", models.BooleanField(default=False, help_text="Run now, by staff.")),
                ("fired_by", models.CharField(blank=True, default="", max_length=250)),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "db_table": "scheduler_runs",
                "ordering": ["schedule_id", "fire_time"],
            },
        ),
        migrations.AddField(
            model_name="job",
            name="fire_time",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="unique_key",
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
        migrations.CreateModel(
            name="Schedule",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("name", models.CharField(max_length=200)),
                (
                    "origin",
                    models.CharField(
                        choices=[("api", "Api"), ("code", "Code"), ("admin", "Admin")],
                        default="admin",
                        max_length=10,
                    ),
                ),
                ("cron", models.CharField(blank=True, max_length=200, null=True)),
                ("interval_seconds", models.IntegerField(blank=True, null=True)),
                ("timezone", models.CharField(default="UTC", max_length=64)),
                ("task", models.CharField(max_length=200)),
                ("payload", models.JSONField(blank=True, default=dict)),
                ("queue", models.CharField(default="default", max_length=100)),
                ("priority", models.SmallIntegerField(default=0)),
                ("max_retries", models.IntegerField(blank=True, null=True)),
                ("enabled", models.BooleanField(default=True)),
                (
                    "catch_up",
                    models.CharField(
                        choices=[("skip", "Skip"), ("all", "All")], default="skip", max_length=10
                    ),
                ),
                (
                    "overlap",
                    models.CharField(
                        choices=[("allow", "Allow"), ("skip", "Skip")],
                        default="allow",
                        max_length=10,
                    ),
                ),
                ("next_fire_at", models.DateTimeField(blank=True, null=True)),
                ("last_fire_at", models.DateTimeField(blank=True, null=True)),
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
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="schedules",
                        to="jobs.client",
                    ),
                ),
            ],
            options={
                "db_table": "jobs_schedule",
                "ordering": ["name", "id"],
                "permissions": [("run_schedule", "Can run a schedule now")],
            },
        ),
        migrations.AddField(
            model_name="job",
            name="schedule",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.DO_NOTHING,
                related_name="jobs",
                to="jobs.schedule",
            ),
        ),
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(
                condition=models.Q(("schedule__isnull", False)),
                fields=["schedule", "-created_at", "-id"],
                name="job_schedule_created_idx",
            ),
        ),
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(
                condition=models.Q(
                    ("schedule__isnull", False),
                    ("status__in", ["enqueue_failed", "processing", "queued"]),
                ),
                fields=["schedule"],
                name="job_schedule_live_idx",
            ),
        ),
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    UNIQUE_KEY_INDEX, "DROP INDEX CONCURRENTLY IF EXISTS job_unique_key_live"
                )
            ],
            state_operations=[
                migrations.AddConstraint(
                    model_name="job",
                    constraint=models.UniqueConstraint(
                        condition=models.Q(
                            ("status__in", ["enqueue_failed", "processing", "queued"]),
                            ("unique_key__isnull", False),
                        ),
                        fields=("client", "unique_key"),
                        name="job_unique_key_live",
                        nulls_distinct=False,
                    ),
                ),
            ],
        ),
        migrations.AddField(
            model_name="schedulerrun",
            name="schedule",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.CASCADE, related_name="runs", to="jobs.schedule"
            ),
        ),
        migrations.AddIndex(
            model_name="schedule",
            index=models.Index(
                condition=models.Q(("enabled", True)),
                fields=["next_fire_at"],
                name="schedule_due_idx",
            ),
        ),
        migrations.AddConstraint(
            model_name="schedule",
            constraint=models.UniqueConstraint(
                fields=("client", "name"), name="schedule_name_per_client", nulls_distinct=False
            ),
        ),
        migrations.AddConstraint(
            model_name="schedule",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(("cron__isnull", False), ("interval_seconds__isnull", True)),
                    models.Q(("cron__isnull", True), ("interval_seconds__isnull", False)),
                    _connector="OR",
                ),
                name="schedule_cron_xor_interval",
            ),
        ),
        migrations.AddConstraint(
            model_name="schedule",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("interval_seconds__isnull", True),
                    ("interval_seconds__gte", 1),
                    _connector="OR",
                ),
                name="schedule_interval_positive",
            ),
        ),
        migrations.AddConstraint(
            model_name="schedule",
            constraint=models.CheckConstraint(
                condition=models.Q(("catch_up__in", ["skip", "all"])),
                name="schedule_catch_up_valid",
            ),
        ),
        migrations.AddConstraint(
            model_name="schedule",
            constraint=models.CheckConstraint(
                condition=models.Q(("overlap__in", ["allow", "skip"])),
                name="schedule_overlap_valid",
            ),
        ),
        migrations.AddConstraint(
            model_name="schedule",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("enabled", False), ("next_fire_at__isnull", False), _connector="OR"
                ),
                name="schedule_enabled_has_next",
            ),
        ),
        migrations.AddConstraint(
            model_name="schedulerrun",
            constraint=models.UniqueConstraint(
                fields=("schedule", "fire_time"), name="scheduler_run_slot"
            ),
        ),
    ]
