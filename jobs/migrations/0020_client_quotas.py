# Per-client quotas (jobs.quotas): three nullable columns on the small jobs_client table,
# no rewrite and no default to fill; NULL takes the setting.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0019_job_timeout"),
    ]

    operations = [
        migrations.AddField(
            model_name="client",
            name="max_schedules",
            field=models.PositiveIntegerField(
                blank=True, help_text="Schedules it may hold; empty: JOBS_MAX_SCHEDULES.", null=True
            ),
        ),
        migrations.AddField(
            model_name="client",
            name="max_signals_per_job",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="Signals one of its jobs may hold; empty: JOBS_MAX_SIGNALS_PER_JOB.",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="client",
            name="max_webhooks",
            field=models.PositiveIntegerField(
                blank=True, help_text="Webhooks it may hold; empty: JOBS_MAX_WEBHOOKS.", null=True
            ),
        ),
    ]
