"""Started is a fact (issue 34): `jobs_job.started_at`, nullable without a default, so
adding it to a live table rewrites nothing and locks only for the catalog change."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0013_event_outbox"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="started_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
