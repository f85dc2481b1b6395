# A job's trace context (jobs.tracing, D300): one nullable column without a default, so
# PostgreSQL adds it to the catalog only (no rewrite of jobs_job, a brief lock); NULL for
# every job submitted outside a trace. A schedule's, for the jobs it fires (D306): the same
# on the small jobs_schedule table.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0025_client_queue_depth"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="trace_context",
            field=models.CharField(blank=True, editable=False, max_length=600, null=True),
        ),
        migrations.AddField(
            model_name="schedule",
            name="trace_context",
            field=models.CharField(blank=True, editable=False, max_length=600, null=True),
        ),
    ]
