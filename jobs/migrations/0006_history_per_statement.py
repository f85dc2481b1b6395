"""History rows written once per statement (transition tables) instead of once per row.

A batched claim or completion of N jobs fires one INSERT into jobs_jobevent instead
of N trigger calls; the history itself is unchanged (one row per status change, same
columns, same actor). Installs the SQL jobs.lifecycle generated then (frozen).
"""

from django.db import migrations

from jobs.migrations._triggers import GUARD_0006, HISTORY_PER_ROW


class Migration(migrations.Migration):
    dependencies = [("jobs", "0005_processing_index_on_id")]

    operations = [
        migrations.RunSQL(GUARD_0006, reverse_sql=HISTORY_PER_ROW),
    ]
