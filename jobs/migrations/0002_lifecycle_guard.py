"""The database-side lifecycle guard and history trigger, as jobs.lifecycle generated
them then (frozen in jobs.migrations._triggers)."""

from django.db import migrations

from jobs.migrations._triggers import DROP_GUARD, GUARD_0002


class Migration(migrations.Migration):
    dependencies = [("jobs", "0001_initial")]

    operations = [
        migrations.RunSQL(
            GUARD_0002,
            reverse_sql=DROP_GUARD,
        ),
    ]
