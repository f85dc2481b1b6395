"""The database-side lifecycle guard and history trigger, generated from jobs.lifecycle."""

from django.db import migrations

from jobs.lifecycle import drop_trigger_sql, guard_trigger_sql


class Migration(migrations.Migration):
    dependencies = [("jobs", "0001_initial")]

    operations = [
        migrations.RunSQL(
            guard_trigger_sql("jobs_job", "jobs_jobevent"),
            reverse_sql=drop_trigger_sql("jobs_job"),
        ),
    ]
