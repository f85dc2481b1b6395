"""Each failed attempt keeps its exception: class, message and a bounded traceback;
each job keeps when it became due, where the SLO clock starts.

Nullable columns without a default (no table rewrite on a large jobs_job). The
worker's fenced fail writes `error_class` / `error_traceback` on the job row in
the same statement as `error`; the per-statement history trigger, reinstalled
here, copies them into the event of the change that ended the attempt and stamps
history with the statement's clock. `due_at` is set by the insert trigger; rows
older than it stay NULL and count from created_at.
"""

from django.db import migrations, models

from jobs.migrations._triggers import GUARD_0006, GUARD_0007


class Migration(migrations.Migration):
    dependencies = [("jobs", "0006_history_per_statement")]

    operations = [
        migrations.AddField(
            model_name="job",
            name="error_class",
            field=models.CharField(
                blank=True,
                help_text="Import path, e.g. builtins.ValueError.",
                max_length=200,
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="job",
            name="error_traceback",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="jobevent",
            name="error_class",
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
        migrations.AddField(
            model_name="jobevent",
            name="error_traceback",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="due_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunSQL(GUARD_0007, reverse_sql=GUARD_0006),
    ]
