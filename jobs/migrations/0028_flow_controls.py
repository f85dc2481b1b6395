"""Flow control per concurrency key (issue 46): a queue's `key_rate` (two nullable
settings on jobs_queue, a handful of rows), the starts and submissions it counts
(jobs_keyhit) and the debounce keys' rows (jobs_debounce). Both tables are new and
empty: nothing on jobs_job changes.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0027_flow_sequences_batches"),
    ]

    operations = [
        migrations.CreateModel(
            name="Debounce",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "client_key",
                    models.BigIntegerField(help_text="The client's id; 0 for jobs from code."),
                ),
                ("key", models.CharField(max_length=200)),
                ("job_id", models.BigIntegerField(blank=True, null=True)),
                ("first_at", models.DateTimeField(blank=True, null=True)),
            ],
            options={
                "db_table": "jobs_debounce",
            },
        ),
        migrations.CreateModel(
            name="KeyHit",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("scope", models.CharField(max_length=10)),
                ("queue", models.CharField(max_length=100)),
                (
                    "client_key",
                    models.BigIntegerField(help_text="The client's id; 0 for jobs from code."),
                ),
                ("key", models.CharField(max_length=200)),
                ("at", models.DateTimeField()),
            ],
            options={
                "db_table": "jobs_keyhit",
            },
        ),
        migrations.AddField(
            model_name="queue",
            name="key_rate_limit",
            field=models.IntegerField(
                blank=True,
                help_text="Most starts of one concurrency key per key rate period (throttle: the others wait).",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="queue",
            name="key_rate_period",
            field=models.IntegerField(blank=True, help_text="Seconds.", null=True),
        ),
        migrations.AddConstraint(
            model_name="queue",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(("key_rate_limit__isnull", True), ("key_rate_period__isnull", True)),
                    models.Q(
                        ("key_rate_limit__gte", 1),
                        ("key_rate_limit__isnull", False),
                        ("key_rate_limit__lte", 1000),
                        ("key_rate_period__gte", 1),
                        ("key_rate_period__isnull", False),
                        ("key_rate_period__lte", 86400),
                    ),
                    _connector="OR",
                ),
                name="queue_key_rate_complete",
            ),
        ),
        migrations.AddConstraint(
            model_name="debounce",
            constraint=models.UniqueConstraint(
                fields=("client_key", "key"), name="debounce_key_unique"
            ),
        ),
        migrations.AddIndex(
            model_name="keyhit",
            index=models.Index(
                fields=["scope", "queue", "client_key", "key", "at"], name="keyhit_window_idx"
            ),
        ),
        migrations.AddIndex(
            model_name="keyhit",
            index=models.Index(fields=["scope", "queue", "at"], name="keyhit_prune_idx"),
        ),
    ]
