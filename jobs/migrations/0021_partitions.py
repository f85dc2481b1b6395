"""jobs_job and jobs_jobevent become range-partitioned tables (issue 33, D155-D163).

Safe on a live 10M-row installation: nothing is copied and no lock is held while rows
are read.

1. Columns with a constant default (`jobs_job.period` 'infinity', `jobs_jobevent.
   job_created_at` '-infinity'): catalog only, no rewrite.
2. The unique indexes that must carry the partition key are built CONCURRENTLY on the
   old table (so this migration is not atomic); the check constraints that prove each
   old table fits its partition bound, and `job_cold_is_finished`, are added NOT VALID
   and validated (a scan under SHARE UPDATE EXCLUSIVE: reads and writes go on).
3. One short transaction (lock_timeout, retried): the old tables are renamed
   (jobs_job_hot, jobs_jobevent_legacy), the partitioned parents created with the
   same columns and named checks, the old tables attached (the validated checks skip
   the scan), their indexes attached to the parents' (no rebuild), the triggers
   re-created on the parents, `id` moved from an identity to a sequence of the parent
   continuing where the identity stopped.

A failed step 2 leaves an INVALID index: drop it and migrate again. The reverse
(`migrate jobs 0020`, with the reapers stopped) moves the cold rows back to the hot
table, then undoes the swap in one short transaction (docs/operations.md "Partitions").
"""

import datetime
import logging
import time

from django.conf import settings
from django.db import OperationalError, migrations, models, transaction

from jobs.migrations._triggers import (
    GUARD_0013,
    GUARD_0021,
    HISTORY_PLAN_0016,
    WORKFLOW_TRIGGERS_0016,
)

log = logging.getLogger("jobs.migrations")

TERMINAL = "('done', 'failed')"
LIVE = "('enqueue_failed', 'processing', 'queued')"
JOB_TRIGGERS = (
    "jobs_job_guard",
    "jobs_job_history_insert",
    "jobs_job_history_update",
    "jobs_job_wait_clear",
    "jobs_job_dependents",
)
# Built on the old table before the swap; the parent's indexes of the same shape
# (with `period`) take them over.
NEW_UNIQUE = {
    "job_unique_key_live": (
        "(client_id, unique_key, period) NULLS NOT DISTINCT "
        f"WHERE unique_key IS NOT NULL AND status IN {LIVE}"
    ),
    "job_idempotency_key_per_client": (
        "(client_id, idempotency_key, period) NULLS NOT DISTINCT WHERE idempotency_key IS NOT NULL"
    ),
}


def first_period_start(now: datetime.datetime) -> datetime.date:
    """The start of the period after `now` (JOBS_PARTITION_PERIOD): history of jobs
    created before it stays in jobs_jobevent_legacy (D160)."""
    period = getattr(settings, "JOBS_PARTITION_PERIOD", "week")
    today = now.astimezone(datetime.UTC).date()
    if period == "day":
        return today + datetime.timedelta(days=1)
    if period == "month":
        return (today.replace(day=1) + datetime.timedelta(days=32)).replace(day=1)
    return today + datetime.timedelta(days=7 - today.weekday())


def _next(start: datetime.date) -> datetime.date:
    period = getattr(settings, "JOBS_PARTITION_PERIOD", "week")
    if period == "day":
        return start + datetime.timedelta(days=1)
    if period == "month":
        return (start + datetime.timedelta(days=32)).replace(day=1)
    return start + datetime.timedelta(days=7)


def _bound(cursor) -> datetime.date:
    """The legacy bound: read back from the check when a previous run added it."""
    cursor.execute(
        "SELECT substring(pg_get_constraintdef(oid) from '''([0-9-]+)') FROM pg_constraint "
        "WHERE conname = 'jobs_jobevent_legacy_bound'"
    )
    row = cursor.fetchone()
    if row:
        return datetime.date.fromisoformat(row[0])
    return first_period_start(datetime.datetime.now(datetime.UTC))


def _exists(cursor, sql: str, params=()) -> bool:
    cursor.execute(sql, params)
    return cursor.fetchone() is not None


def _prepare(cursor, bound: datetime.date) -> None:
    """Step 1 and 2: nothing here blocks writes for longer than a catalog change."""
    cursor.execute("SET lock_timeout = '10s'")
    cursor.execute(
        "ALTER TABLE jobs_job ADD COLUMN IF NOT EXISTS period date NOT NULL DEFAULT 'infinity'"
    )
    cursor.execute(
        "ALTER TABLE jobs_jobevent ADD COLUMN IF NOT EXISTS "
        "job_created_at timestamptz NOT NULL DEFAULT '-infinity'"
    )
    for name, definition in NEW_UNIQUE.items():
        cursor.execute(
            f"CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS jobs_job_hot_{name} "
            f"ON jobs_job {definition}"
        )
    checks = [
        ("jobs_job", "job_cold_is_finished", f"period = 'infinity' OR status IN {TERMINAL}"),
        ("jobs_job", "jobs_job_hot_bound", "period >= 'infinity'"),
        ("jobs_jobevent", "jobs_jobevent_legacy_bound", f"job_created_at < '{bound} 00:00:00+00'"),
    ]
    for table, name, check in checks:
        if not _exists(cursor, "SELECT 1 FROM pg_constraint WHERE conname = %s", [name]):
            cursor.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} CHECK ({check}) NOT VALID")
        cursor.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {name}")
    cursor.execute("RESET lock_timeout")


def _index_defs(cursor, table: str) -> list[tuple[str, str]]:
    """(name, definition) of the table's indexes other than its primary key."""
    cursor.execute(
        "SELECT c.relname, pg_get_indexdef(i.indexrelid) FROM pg_index i "
        "JOIN pg_class c ON c.oid = i.indexrelid "
        "WHERE i.indrelid = %s::regclass AND NOT i.indisprimary ORDER BY c.relname",
        [table],
    )
    return cursor.fetchall()


def _identity_to_sequence(cursor, table: str) -> None:
    """PG15 has no identity column on a partitioned table: a sequence owned by the
    parent's id continues where the identity stopped (dropping the identity drops
    its sequence, so the new one is set first)."""
    cursor.execute(f"CREATE SEQUENCE {table}_id_seq_p AS bigint")
    cursor.execute(f"SELECT setval('{table}_id_seq_p', last_value, is_called) FROM {table}_id_seq")
    cursor.execute(f"ALTER TABLE {table} ALTER COLUMN id DROP IDENTITY")
    cursor.execute(f"ALTER SEQUENCE {table}_id_seq_p RENAME TO {table}_id_seq")


def _swap(cursor, bound: datetime.date) -> float:
    """Step 3, inside one transaction that holds ACCESS EXCLUSIVE on both old tables
    for the length of catalog changes only."""
    cursor.execute("SET LOCAL lock_timeout = '2s'")
    cursor.execute("LOCK TABLE jobs_job, jobs_jobevent IN ACCESS EXCLUSIVE MODE")
    locked = time.monotonic()
    for table in ("jobs_job", "jobs_jobevent"):
        _identity_to_sequence(cursor, table)
    for trigger in JOB_TRIGGERS:
        cursor.execute(f"DROP TRIGGER IF EXISTS {trigger} ON jobs_job")
    # The old unique indexes without period give way to the ones built in step 2.
    for name in NEW_UNIQUE:
        cursor.execute(f"DROP INDEX {name}")
    parts = {"jobs_job": "jobs_job_hot", "jobs_jobevent": "jobs_jobevent_legacy"}
    indexes = {}
    for parent, part in parts.items():
        indexes[parent] = _index_defs(cursor, parent)
        cursor.execute(f"ALTER TABLE {parent} RENAME TO {part}")
        cursor.execute(f"ALTER TABLE {part} RENAME CONSTRAINT {parent}_pkey TO {part}_pkey")
        for name, _ in indexes[parent]:
            if not name.startswith(part):
                cursor.execute(f"ALTER INDEX {name} RENAME TO {part}_{name}")
    cursor.execute(
        "CREATE TABLE jobs_job (LIKE jobs_job_hot INCLUDING DEFAULTS INCLUDING CONSTRAINTS) "
        "PARTITION BY RANGE (period)"
    )
    cursor.execute("ALTER TABLE jobs_job DROP CONSTRAINT jobs_job_hot_bound")
    cursor.execute(
        "ALTER TABLE jobs_job ATTACH PARTITION jobs_job_hot "
        "FOR VALUES FROM ('infinity') TO (MAXVALUE)"
    )
    cursor.execute("ALTER TABLE jobs_job_hot DROP CONSTRAINT jobs_job_hot_bound")
    cursor.execute(
        "CREATE TABLE jobs_jobevent (LIKE jobs_jobevent_legacy INCLUDING DEFAULTS "
        "INCLUDING CONSTRAINTS) PARTITION BY RANGE (job_created_at)"
    )
    cursor.execute("ALTER TABLE jobs_jobevent DROP CONSTRAINT jobs_jobevent_legacy_bound")
    cursor.execute(
        "ALTER TABLE jobs_jobevent ATTACH PARTITION jobs_jobevent_legacy "
        f"FOR VALUES FROM (MINVALUE) TO ('{bound} 00:00:00+00')"
    )
    cursor.execute("ALTER TABLE jobs_jobevent_legacy DROP CONSTRAINT jobs_jobevent_legacy_bound")
    for parent, part in parts.items():
        cursor.execute(
            f"ALTER TABLE {parent} ALTER COLUMN id SET DEFAULT nextval('{parent}_id_seq')"
        )
        cursor.execute(f"ALTER SEQUENCE {parent}_id_seq OWNED BY {parent}.id")
        # Each index of the old table becomes the partition's index of the parent's
        # index of the same definition: no rebuild, and a mismatch fails loudly.
        for name, definition in indexes[parent]:
            own = name if name.startswith(f"{part}_") else f"{part}_{name}"
            on_parent = own[len(part) + 1 :]
            head = f" INDEX {name} ON public.{parent} "
            assert head in definition, definition
            cursor.execute(
                definition.replace(head, f" INDEX {on_parent} ON ONLY public.{parent} ", 1)
            )
            cursor.execute(f"ALTER INDEX {on_parent} ATTACH PARTITION {own}")
    cursor.execute(
        "ALTER TABLE jobs_job ADD CONSTRAINT jobs_job_client_id_8aaadee3_fk_jobs_client_id "
        "FOREIGN KEY (client_id) REFERENCES jobs_client (id) DEFERRABLE INITIALLY DEFERRED"
    )
    cursor.execute(GUARD_0021)
    cursor.execute(WORKFLOW_TRIGGERS_0016)
    cursor.execute(HISTORY_PLAN_0016)
    # History partitions for the first periods (the reaper keeps creating them ahead).
    start = bound
    for _ in range(3):
        end = _next(start)
        cursor.execute(
            f"CREATE TABLE jobs_jobevent_p{start:%Y%m%d} PARTITION OF jobs_jobevent "
            f"FOR VALUES FROM ('{start} 00:00:00+00') TO ('{end} 00:00:00+00')"
        )
        cursor.execute(f"ALTER TABLE jobs_jobevent_p{start:%Y%m%d} ADD PRIMARY KEY (id)")
        start = end
    return locked


def forward(apps, schema_editor) -> None:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        if _exists(cursor, "SELECT 1 FROM pg_class WHERE relname = 'jobs_job_hot'"):
            return
        bound = _bound(cursor)
        _prepare(cursor, bound)
    for attempt in range(30):
        try:
            started = time.monotonic()
            with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
                locked = _swap(cursor, bound)
            log.info(
                "0021: the swap waited %.1f ms for its locks and held ACCESS EXCLUSIVE "
                "for %.1f ms (attempt %d)",
                (locked - started) * 1000,
                (time.monotonic() - locked) * 1000,
                attempt + 1,
            )
            return
        except OperationalError as exc:  # lock_timeout: writers held a lock; try again
            if "lock timeout" not in str(exc) or attempt == 29:
                raise
            time.sleep(min(0.2 * (attempt + 1), 3))


_MOVE_BACK = """
UPDATE jobs_job SET period = 'infinity'
WHERE id IN (SELECT id FROM jobs_job WHERE period < 'infinity' LIMIT 5000)"""


def _unswap(cursor) -> None:
    """The reverse of _swap, in one transaction: the old tables detached and renamed
    back, history written since copied into the old history table (the only copy: the
    rows of the periods since the migration), identities and 0020's triggers back."""
    cursor.execute("SET LOCAL lock_timeout = '2s'")
    cursor.execute("LOCK TABLE jobs_job, jobs_jobevent IN ACCESS EXCLUSIVE MODE")
    if _exists(cursor, "SELECT 1 FROM jobs_job WHERE period < 'infinity' LIMIT 1"):
        raise RuntimeError("jobs_job has cold rows: stop the reapers (the mover) and migrate again")
    sequences = {}
    for table in ("jobs_job", "jobs_jobevent"):
        cursor.execute(f"SELECT last_value, is_called FROM {table}_id_seq")
        sequences[table] = cursor.fetchone()
    for trigger in JOB_TRIGGERS:
        cursor.execute(f"DROP TRIGGER IF EXISTS {trigger} ON jobs_job")
    parts = {"jobs_job": "jobs_job_hot", "jobs_jobevent": "jobs_jobevent_legacy"}
    for parent, part in parts.items():
        cursor.execute(f"ALTER TABLE {parent} DETACH PARTITION {part}")
        cursor.execute(f"ALTER TABLE {part} ALTER COLUMN id DROP DEFAULT")  # the parent's
    cursor.execute(
        "SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) FROM pg_attribute "
        "WHERE attrelid = 'jobs_jobevent_legacy'::regclass AND attnum > 0 AND NOT attisdropped"
    )
    columns = cursor.fetchone()[0]
    cursor.execute(
        f"INSERT INTO jobs_jobevent_legacy ({columns}) SELECT {columns} FROM jobs_jobevent"
    )
    for parent, part in parts.items():
        cursor.execute(f"DROP TABLE {parent}")  # the parent, its sequence, empty partitions
        cursor.execute(f"ALTER TABLE {part} RENAME TO {parent}")
        cursor.execute(f"ALTER TABLE {parent} RENAME CONSTRAINT {part}_pkey TO {parent}_pkey")
        for name, _ in _index_defs(cursor, parent):
            if name.startswith(f"{part}_") and name[len(part) + 1 :] not in NEW_UNIQUE:
                cursor.execute(f"ALTER INDEX {name} RENAME TO {name[len(part) + 1 :]}")
        cursor.execute(f"ALTER TABLE {parent} ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY")
        cursor.execute(
            f"SELECT setval(pg_get_serial_sequence('{parent}', 'id'), %s, %s)",
            list(sequences[parent]),
        )
    cursor.execute(GUARD_0013)
    cursor.execute(WORKFLOW_TRIGGERS_0016)
    cursor.execute(HISTORY_PLAN_0016)


def backward(apps, schema_editor) -> None:
    """Cold rows are moved back to the hot table first (in batches, the guard lets a
    move through), then the swap is undone; 0020's unique indexes are built
    CONCURRENTLY before the partition columns go. Stop the reapers first: the mover
    would move rows out again."""
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        if not _exists(cursor, "SELECT 1 FROM pg_class WHERE relname = 'jobs_job_hot'"):
            return
        while True:
            cursor.execute(_MOVE_BACK)
            if cursor.rowcount == 0:
                break
    for attempt in range(30):
        try:
            with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
                _unswap(cursor)
            break
        except OperationalError as exc:
            if "lock timeout" not in str(exc) or attempt == 29:
                raise
            time.sleep(min(0.2 * (attempt + 1), 3))
    with connection.cursor() as cursor:
        for name, definition in NEW_UNIQUE.items():
            old = definition.replace(", period)", ")")
            cursor.execute(
                f"CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {name} ON jobs_job {old}"
            )
        cursor.execute("SET lock_timeout = '10s'")
        # Drops the period indexes and job_cold_is_finished with it: catalog only.
        cursor.execute("ALTER TABLE jobs_job DROP COLUMN period")
        cursor.execute("ALTER TABLE jobs_jobevent DROP COLUMN job_created_at")
        cursor.execute("RESET lock_timeout")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY; the swap runs in its own transaction

    dependencies = [
        ("jobs", "0020_client_quotas"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(forward, backward)],
            state_operations=[
                migrations.AddField(
                    model_name="job",
                    name="period",
                    field=models.DateField(
                        default=datetime.date.max,
                        editable=False,
                        help_text="The partition: 'infinity' (hot) until the mover moves "
                        "the finished job to the period of its created_at.",
                    ),
                ),
                migrations.AddField(
                    model_name="jobevent",
                    name="job_created_at",
                    field=models.DateTimeField(
                        default=datetime.datetime.min.replace(tzinfo=datetime.UTC),
                        editable=False,
                    ),
                ),
                migrations.RemoveConstraint(
                    model_name="job", name="job_idempotency_key_per_client"
                ),
                migrations.RemoveConstraint(model_name="job", name="job_unique_key_live"),
                migrations.AddConstraint(
                    model_name="job",
                    constraint=models.UniqueConstraint(
                        condition=models.Q(("idempotency_key__isnull", False)),
                        fields=("client", "idempotency_key", "period"),
                        name="job_idempotency_key_per_client",
                        nulls_distinct=False,
                    ),
                ),
                migrations.AddConstraint(
                    model_name="job",
                    constraint=models.UniqueConstraint(
                        condition=models.Q(
                            ("status__in", ["enqueue_failed", "processing", "queued"]),
                            ("unique_key__isnull", False),
                        ),
                        fields=("client", "unique_key", "period"),
                        name="job_unique_key_live",
                        nulls_distinct=False,
                    ),
                ),
                migrations.AddConstraint(
                    model_name="job",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            ("period", datetime.date.max),
                            ("status__in", ["done", "failed"]),
                            _connector="OR",
                        ),
                        name="job_cold_is_finished",
                    ),
                ),
            ],
        ),
    ]
