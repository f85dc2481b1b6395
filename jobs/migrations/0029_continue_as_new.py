# Continue-as-new (jobs.durable, D315): four nullable columns on jobs_job, no default to
# fill and no rewrite; no index (a chain is followed by its links, never searched).

import django.contrib.postgres.fields
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0028_flow_controls"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="chain_id",
            field=models.BigIntegerField(
                blank=True, help_text="The first run's id, on every run of a chain.", null=True
            ),
        ),
        migrations.AddField(
            model_name="job",
            name="run_number",
            field=models.IntegerField(
                blank=True, help_text="Its run in the chain (1 when empty).", null=True
            ),
        ),
        migrations.AddField(
            model_name="job",
            name="previous_run_ids",
            field=django.contrib.postgres.fields.ArrayField(
                base_field=models.BigIntegerField(),
                blank=True,
                help_text="The ids of the earlier runs, oldest first (the last "
                "JOBS_CHAIN_IDS_KEPT).",
                null=True,
                size=None,
            ),
        ),
        migrations.AddField(
            model_name="job",
            name="next_run_id",
            field=models.BigIntegerField(
                blank=True, help_text="The run it continued as (it ended done).", null=True
            ),
        ),
    ]
