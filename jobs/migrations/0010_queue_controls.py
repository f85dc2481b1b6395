"""Queue controls (issue 19): a new jobs_queue table, one row per declared queue.

A new, small table: jobs_job is untouched (no rewrite, no lock on it).
"""

import django.contrib.postgres.fields
import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0009_progress_and_cancel_request"),
    ]

    operations = [
        migrations.CreateModel(
            name="Queue",
            fields=[
                ("name", models.CharField(max_length=100, primary_key=True, serialize=False)),
                ("paused", models.BooleanField(default=False)),
                (
                    "concurrency",
                    models.IntegerField(
                        blank=True,
                        help_text="Most jobs processing at once across all workers.",
                        null=True,
                    ),
                ),
                (
                    "rate_limit",
                    models.IntegerField(
                        blank=True,
                        help_text="Most job starts per rate period across all workers.",
                        null=True,
                    ),
                ),
                (
                    "rate_period",
                    models.IntegerField(
                        blank=True,
                        choices=[(1, "second"), (60, "minute"), (3600, "hour")],
                        help_text="Seconds.",
                        null=True,
                    ),
                ),
                (
                    "weight",
                    models.FloatField(
                        blank=True,
                        help_text="Polling weight for workers serving several queues without a weight of their own for it (runworker --queues a:4 wins).",
                        null=True,
                    ),
                ),
                (
                    "rate_starts",
                    django.contrib.postgres.fields.ArrayField(
                        base_field=models.DateTimeField(), blank=True, default=list, size=None
                    ),
                ),
                ("declared", models.JSONField(blank=True, default=dict)),
                (
                    "updated_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "db_table": "jobs_queue",
                "ordering": ["name"],
                "permissions": [("pause_queue", "Can pause and resume queues")],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(
                            ("concurrency__isnull", True), ("concurrency__gte", 1), _connector="OR"
                        ),
                        name="queue_concurrency_positive",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("rate_limit__isnull", True), ("rate_period__isnull", True)),
                            models.Q(
                                ("rate_limit__gte", 1),
                                ("rate_limit__isnull", False),
                                ("rate_limit__lte", 1000),
                                ("rate_period__in", [1, 60, 3600]),
                                ("rate_period__isnull", False),
                            ),
                            _connector="OR",
                        ),
                        name="queue_rate_complete",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            ("weight__isnull", True),
                            models.Q(("weight__gt", 0), ("weight__lte", 1000)),
                            _connector="OR",
                        ),
                        name="queue_weight_range",
                    ),
                ],
            },
        ),
    ]
