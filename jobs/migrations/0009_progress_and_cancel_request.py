"""Progress of running jobs and cancel requests for them (issue 22).

Two nullable columns without a default (no table rewrite on a large jobs_job):
`progress`, written by the worker's fenced heartbeat, and `cancel_requested_at`,
set when a client or staff member cancels a processing job. The guard trigger,
reinstalled here, clears `progress` on a claim and ends a job with a pending cancel
request as failed "cancelled" when any path would put it back to queued, and a
check constraint says a waiting job never carries a pending request. It is added NOT
VALID (no scan under the ACCESS EXCLUSIVE lock) and validated in its own statement,
which scans under a lock that lets reads and writes go on.
"""

from django.db import migrations, models

from jobs.migrations._triggers import GUARD_0007, GUARD_0009


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0008_worker_registry"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="progress",
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="cancel_requested_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AlterModelOptions(
            name="job",
            options={
                "permissions": [
                    ("retry_job", "Can retry failed jobs (resets the retry budget)"),
                    ("repair_job", "Can repair enqueue_failed jobs"),
                    ("revoke_job", "Can revoke the lease of processing jobs"),
                    ("cancel_job", "Can cancel jobs that have not started"),
                    ("cancel_running_job", "Can ask running jobs to stop (cancel running)"),
                ]
            },
        ),
        migrations.RunSQL(GUARD_0009, reverse_sql=GUARD_0007),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddConstraint(
                    model_name="job",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("status__in", ["queued", "enqueue_failed"]), _negated=True),
                            ("cancel_requested_at__isnull", True),
                            _connector="OR",
                        ),
                        name="job_waiting_has_no_cancel_request",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    "ALTER TABLE jobs_job ADD CONSTRAINT job_waiting_has_no_cancel_request "
                    "CHECK (status NOT IN ('queued', 'enqueue_failed') "
                    "OR cancel_requested_at IS NULL) NOT VALID",
                    reverse_sql="ALTER TABLE jobs_job "
                    "DROP CONSTRAINT job_waiting_has_no_cancel_request",
                ),
                migrations.RunSQL(
                    "ALTER TABLE jobs_job VALIDATE CONSTRAINT job_waiting_has_no_cancel_request",
                    reverse_sql=migrations.RunSQL.noop,
                ),
            ],
        ),
    ]
