"""Fair share and concurrency keys (issue 28).

On jobs_job one nullable column without a default (no rewrite) and two partial indexes
built CONCURRENTLY (so the migration is not atomic): the fair claim's (queue, client,
claim order) over queued rows, and the keyed claim's count of processing rows per key.
jobs_queue (one row per declared queue) gains two settings (`fair` with a database
default, so the previous release's workers can still insert rows), jobs_schedule the
key its jobs carry (nullable, no default).
"""

import django.db.models.functions.comparison
from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("jobs", "0016_linear_workflows_backpressure"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="concurrency_key",
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
        migrations.AddField(
            model_name="schedule",
            name="concurrency_key",
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
        migrations.AddField(
            model_name="queue",
            name="fair",
            field=models.BooleanField(
                db_default=False,
                default=False,
                help_text="Claims take turns between the clients with due work.",
            ),
        ),
        migrations.AddField(
            model_name="queue",
            name="key_concurrency",
            field=models.IntegerField(
                blank=True,
                help_text="Most jobs with one concurrency key processing at once across all workers.",
                null=True,
            ),
        ),
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(
                models.F("queue"),
                django.db.models.functions.comparison.Coalesce(models.F("client"), models.Value(0)),
                models.OrderBy(models.F("priority"), descending=True),
                models.F("run_at"),
                models.F("id"),
                condition=models.Q(("status", "queued")),
                name="job_fair_claim_idx",
            ),
        ),
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(
                condition=models.Q(("concurrency_key__isnull", False), ("status", "processing")),
                fields=["queue", "client", "concurrency_key"],
                name="job_key_processing_idx",
            ),
        ),
        migrations.AddConstraint(
            model_name="queue",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("key_concurrency__isnull", True),
                    ("key_concurrency__gte", 1),
                    _connector="OR",
                ),
                name="queue_key_concurrency_positive",
            ),
        ),
    ]
