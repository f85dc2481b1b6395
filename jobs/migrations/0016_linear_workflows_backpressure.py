"""Workflow triggers linear in the edges they touch; webhook deliveries held by a full
queue (issue 28).

Replaces the functions of the workflow triggers (CREATE OR REPLACE FUNCTION; the
triggers are created only if missing: no lock on jobs_job). The old dependents
function labelled every descendant with every failed root (work of roots x
descendants x edges in one statement) and marked each settled edge (a write per
edge); the new one walks each not-started job once and writes no edge (D107). The history trigger's function gets a hash join for
its transition tables (ALTER FUNCTION ... SET: no lock on jobs_job, body untouched).
A partial index of the webhook deliveries still waiting for a job (built
CONCURRENTLY, so the migration is not atomic) serves the release of those a full
queue held back (D110). `jobs_jobdependency.settled` leaves the model but stays in
the table with its default, so code still inserting it keeps working until a later
release drops it.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models

from jobs.migrations._triggers import (
    HISTORY_PLAN_0016,
    HISTORY_PLAN_RESET,
    WORKFLOW_TRIGGERS_0012,
    WORKFLOW_TRIGGERS_0016,
)


class Migration(migrations.Migration):
    atomic = False  # the index is built CONCURRENTLY

    dependencies = [
        ("jobs", "0015_webhook_circuit"),
    ]

    operations = [
        migrations.RunSQL(WORKFLOW_TRIGGERS_0016, WORKFLOW_TRIGGERS_0012),
        migrations.RunSQL(HISTORY_PLAN_0016, HISTORY_PLAN_RESET),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.RemoveField(model_name="jobdependency", name="settled")],
        ),
        AddIndexConcurrently(
            model_name="webhookdelivery",
            index=models.Index(
                condition=models.Q(("job__isnull", True)),
                fields=["webhook", "source_job_id", "seq", "id"],
                name="delivery_waiting_idx",
            ),
        ),
    ]
