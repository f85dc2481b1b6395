"""The worker registry: one row per running worker process (a new table; jobs_job is untouched)."""

import django.contrib.postgres.fields
import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0007_error_detail_and_due_at"),
    ]

    operations = [
        migrations.CreateModel(
            name="WorkerProcess",
            fields=[
                (
                    "id",
                    models.CharField(
                        help_text="As in Job.owned_by.",
                        max_length=200,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("hostname", models.CharField(max_length=255)),
                ("pid", models.IntegerField()),
                (
                    "backend_pid",
                    models.IntegerField(
                        blank=True,
                        help_text="PostgreSQL backend of the presence connection.",
                        null=True,
                    ),
                ),
                ("lock_key", models.IntegerField(blank=True, null=True)),
                (
                    "queues",
                    django.contrib.postgres.fields.ArrayField(
                        base_field=models.CharField(max_length=100),
                        help_text="'*' serves every queue.",
                        size=None,
                    ),
                ),
                ("concurrency", models.IntegerField()),
                (
                    "started_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                (
                    "heartbeat_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "db_table": "jobs_worker",
                "ordering": ["id"],
            },
        ),
    ]
