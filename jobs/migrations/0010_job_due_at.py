"""Job.due_at: when a job became due if not at creation (SPEC §6's SLO clock).

A nullable column without a default: a catalog-only change on a live table, no rewrite
and no backfill (NULL reads as created_at, which is right for every existing
immediate job).
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0006_history_per_statement"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="due_at",
            field=models.DateTimeField(
                blank=True,
                help_text="When the job became due, if not at creation: a future run_at at submission, or a staff retry. The SLO counts from here (lifecycle.due_sql).",
                null=True,
            ),
        ),
    ]
