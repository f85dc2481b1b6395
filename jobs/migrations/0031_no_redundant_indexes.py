"""Eleven indexes that another index of the same table already serves go (D406).

Each is Django's index on a foreign key whose column leads another index of its table:
`jobs_job.client_id` (job_client_created_idx), `jobs_jobevent.job_id` (jobevent_job_idx),
`jobs_webhookdelivery.webhook_id` (delivery_once_per_event, delivery_chain_idx),
`jobs_jobdependency.child_id` (jobdependency_uniq) and `.parent_id` (a second copy of
jobdependency_parent_idx), and six more of tables written less often (signals, workflow
nodes, sequence waits, batch failures, webhooks, schedules: each table's unique key or
named index leads with the column). A job's insert and each of its status changes (not
HOT: the status is indexed) wrote an entry into the first, each history row one into the
second. tests/test_indexes.py keeps it so.

The plain tables' indexes are dropped CONCURRENTLY (the migration is not atomic). A
partitioned table's index cannot be: its DROP takes ACCESS EXCLUSIVE on the parent and
its partitions for a catalog change of milliseconds. While it waits for that lock every
writer queues behind it, so it waits LOCK_WAIT_MS at most and tries again after a pause:
a long transaction on the table delays the migration, and the jobs by LOCK_WAIT_MS a try
at most. The reverse builds them again (the partitioned ones without CONCURRENTLY: writes
wait while they build).
"""

import logging
import time

from django.db import OperationalError, migrations, models, transaction

log = logging.getLogger("jobs.migrations")

PLAIN = {
    "jobs_webhookdelivery_webhook_id_14e823cc": "jobs_webhookdelivery (webhook_id)",
    "jobs_jobdependency_child_id_264a6e8f": "jobs_jobdependency (child_id)",
    "jobs_jobdependency_parent_id_1a2db807": "jobs_jobdependency (parent_id)",
    "jobs_jobsignal_job_id_0d159881": "jobs_jobsignal (job_id)",
    "jobs_workflownode_workflow_id_2a466b05": "jobs_workflownode (workflow_id)",
    "jobs_sequencewait_sequence_id_eaaa61a5": "jobs_sequencewait (sequence_id)",
    "jobs_batchfailure_batch_id_1ffc6942": "jobs_batchfailure (batch_id)",
    "jobs_webhook_client_id_8c95ce4e": "jobs_webhook (client_id)",
    "jobs_schedule_client_id_01cdfa80": "jobs_schedule (client_id)",
}
# A writer queued behind the DROP's lock request waits this long at most, per try.
LOCK_WAIT_MS = 100
TRIES = 300
PARTITIONED = {
    "jobs_job_client_id_8aaadee3": "jobs_job (client_id)",
    "jobs_jobevent_job_id_79067df7": "jobs_jobevent (job_id)",
}


def drop_partitioned(apps, schema_editor) -> None:
    connection = schema_editor.connection
    for index in PARTITIONED:
        for attempt in range(TRIES):
            try:
                started = time.monotonic()
                with transaction.atomic(using=connection.alias), connection.cursor() as cur:
                    cur.execute(f"SET LOCAL lock_timeout = '{LOCK_WAIT_MS}ms'")
                    cur.execute(f"DROP INDEX IF EXISTS {index}")
                log.info("0031: %s dropped in %.1f ms (attempt %d)", index,
                         (time.monotonic() - started) * 1000, attempt + 1)  # fmt: skip
                break
            except OperationalError as exc:  # lock_timeout: a transaction held the table
                if "lock timeout" not in str(exc) or attempt == TRIES - 1:
                    raise
                time.sleep(min(0.1 * (attempt + 1), 2))


def create_partitioned(apps, schema_editor) -> None:
    with schema_editor.connection.cursor() as cur:
        for index, on in PARTITIONED.items():
            cur.execute(f"CREATE INDEX IF NOT EXISTS {index} ON {on}")


# The foreign keys declared db_index=False: (model, field, target, related name, options).
_LOOSE = {"db_constraint": False, "on_delete": models.deletion.DO_NOTHING}
_CLIENT = {"blank": True, "null": True, "on_delete": models.deletion.PROTECT}
KEYS = [
    ("job", "client", "jobs.client", "jobs", _CLIENT),
    ("jobdependency", "child", "jobs.job", "parent_links", _LOOSE),
    ("jobdependency", "parent", "jobs.job", "child_links", _LOOSE),
    ("jobevent", "job", "jobs.job", "events", _LOOSE),
    ("batchfailure", "batch", "jobs.batch", "failures", _LOOSE),
    ("jobsignal", "job", "jobs.job", "signals", _LOOSE),
    ("schedule", "client", "jobs.client", "schedules", _CLIENT),
    ("sequencewait", "sequence", "jobs.sequence", "waits", _LOOSE),
    ("webhook", "client", "jobs.client", "webhooks", {"on_delete": models.deletion.CASCADE}),
    ("workflownode", "workflow", "jobs.workflow", "nodes", _LOOSE),
    ("webhookdelivery", "webhook", "jobs.webhook", "deliveries",
     {"on_delete": models.deletion.CASCADE}),
]  # fmt: skip


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("jobs", "0030_jobstep_one_index")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name=model,
                    name=name,
                    field=models.ForeignKey(db_index=False, related_name=related, to=to, **options),
                )
                for model, name, to, related, options in KEYS
            ],
            database_operations=[
                *(
                    migrations.RunSQL(
                        f"DROP INDEX CONCURRENTLY IF EXISTS {index}",
                        reverse_sql=f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {index} ON {on}",
                    )
                    for index, on in PLAIN.items()
                ),
                migrations.RunPython(drop_partitioned, create_partitioned),
            ],
        ),
    ]
