"""A durable step's row loses the index on job_id alone (D369).

The unique (job_id, name) constraint's index leads with job_id and serves every look-up
by job (the replay's read, the retention's delete), so the foreign key's own index was a
second entry per checkpoint for nothing. Dropped CONCURRENTLY (the migration is not
atomic): no lock that blocks the checkpoints of running durable jobs.
"""

import django.db.models.deletion
from django.db import migrations, models

INDEX = "jobs_jobstep_job_id_dccb215d"


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("jobs", "0029_continue_as_new")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="jobstep",
                    name="job",
                    field=models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="steps",
                        to="jobs.job",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}",
                    reverse_sql=f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {INDEX} "
                    "ON jobs_jobstep (job_id)",
                ),
            ],
        ),
    ]
