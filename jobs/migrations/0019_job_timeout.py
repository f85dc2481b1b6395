"""A job's own attempt timeout (issue 27), and a schedule's for the jobs it makes:
nullable columns without a default, so PostgreSQL adds them to the catalog only (no
rewrite of jobs_job, a brief lock). NULL means the task's timeout or
JOBS_DEFAULT_TIMEOUT; the range is checked at submission."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0018_domainevent_key"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="timeout",
            field=models.FloatField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="schedule",
            name="timeout",
            field=models.FloatField(blank=True, null=True),
        ),
    ]
