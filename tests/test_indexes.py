"""No table of the service carries an index that another of its indexes already serves
(D406): a plain index whose columns (and operator classes) begin another index of the
same table costs every insert, and every update that is not HOT, an entry for nothing.
Django adds one per foreign key; a model whose key leads an index or a constraint of its
own declares it `db_index=False`."""

from __future__ import annotations

import importlib
import threading
import time
from types import SimpleNamespace

import psycopg
import pytest
from django.db import connection, connections

from harness import database_url

pytestmark = pytest.mark.django_db

# (table, index, an index of the same table that begins with its columns). Partitions are
# left out (they mirror their parent's indexes), and so is the pre-partitioning history
# table 0021 kept (written no more). Pattern-ops indexes differ in operator class.
_COVERED_SQL = """
SELECT t.relname, ai.relname, bi.relname
FROM pg_index a
JOIN pg_index b ON b.indrelid = a.indrelid AND b.indexrelid <> a.indexrelid
JOIN pg_class t ON t.oid = a.indrelid
JOIN pg_class ai ON ai.oid = a.indexrelid
JOIN pg_class bi ON bi.oid = b.indexrelid
WHERE t.relname LIKE 'jobs\\_%%' AND NOT t.relispartition
  AND NOT a.indisunique AND a.indpred IS NULL AND a.indexprs IS NULL
  AND b.indpred IS NULL AND b.indexprs IS NULL
  AND (b.indkey::text || ' ') LIKE (a.indkey::text || ' %%')
  AND (b.indclass::text || ' ') LIKE (a.indclass::text || ' %%')
  AND (a.indkey::text <> b.indkey::text OR a.indexrelid > b.indexrelid)
ORDER BY 1, 2
"""


def covered() -> list[tuple[str, str, str]]:
    with connection.cursor() as cur:
        cur.execute(_COVERED_SQL)
        return cur.fetchall()


def test_no_index_is_served_by_another_of_its_table():
    assert covered() == []


def test_the_check_finds_an_index_another_one_serves():
    """The same query finds what migration 0031 dropped, built again."""
    migration = importlib.import_module("jobs.migrations.0031_no_redundant_indexes")
    with connection.cursor() as cur:
        for index, on in {**migration.PLAIN, **migration.PARTITIONED}.items():
            cur.execute(f"CREATE INDEX {index} ON {on}")
    found = {index for _, index, _ in covered()}
    assert found == {*migration.PLAIN, *migration.PARTITIONED}


@pytest.mark.django_db(transaction=True)
def test_the_partitioned_drop_never_holds_the_writers_behind_a_long_transaction():
    """Migration 0031's DROP of a partitioned table's index needs ACCESS EXCLUSIVE. Behind
    a transaction that holds the table, its request makes every writer queue too; it gives
    up after LOCK_WAIT_MS and asks again later, so a job's write waits that long at most,
    and the drop goes through once the transaction ends."""
    migration = importlib.import_module("jobs.migrations.0031_no_redundant_indexes")
    index = "jobs_job_client_id_8aaadee3"
    with connection.cursor() as cur:
        cur.execute(f"CREATE INDEX {index} ON jobs_job (client_id)")
    insert = ("INSERT INTO jobs_job (task, payload, queue, priority, run_at, max_retries, "
              "updated_by, status, retry_count, lease_version) VALUES ('echo', '{}', "
              "'default', 0, now(), 0, 'test', 'queued', 0, 0)")  # fmt: skip
    waiting_sql = ("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                   "AND query LIKE 'DROP INDEX%%'")  # fmt: skip
    holder = psycopg.connect(database_url())
    writer = psycopg.connect(database_url(), autocommit=True)
    watcher = psycopg.connect(database_url(), autocommit=True)
    done: list[BaseException | None] = []

    def drop() -> None:
        try:
            migration.drop_partitioned(None, SimpleNamespace(connection=connections["default"]))
            done.append(None)
        except BaseException as exc:  # handed to the test
            done.append(exc)
        finally:
            connections.close_all()

    try:
        holder.execute("SELECT count(*) FROM jobs_job")  # a long transaction holds the table
        thread = threading.Thread(target=drop, daemon=True)
        thread.start()
        slowest, seen_waiting, tries = 0.0, 0, 0
        deadline = time.monotonic() + 30
        while seen_waiting < 3 or tries < 20:  # the drop seen waiting for its lock, thrice
            assert time.monotonic() < deadline, (seen_waiting, tries)
            started = time.monotonic()
            writer.execute(insert)
            slowest = max(slowest, time.monotonic() - started)
            tries += 1
            seen_waiting += watcher.execute(waiting_sql).fetchone()[0]
        assert not done  # still waiting for the long transaction
        assert slowest < 1.0, slowest  # a writer never waits out a long lock_timeout
        holder.rollback()  # the transaction ends: the drop goes through
        thread.join(30)
        assert done == [None]
        exists = watcher.execute("SELECT to_regclass(%s)", [index]).fetchone()[0]
        assert exists is None
    finally:
        for c in (holder, writer, watcher):
            c.close()
