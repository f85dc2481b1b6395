"""No table of the service carries an index that another of its indexes already serves
(D406): a plain index whose columns (and operator classes) begin another index of the
same table costs every insert, and every update that is not HOT, an entry for nothing.
Django adds one per foreign key; a model whose key leads an index or a constraint of its
own declares it `db_index=False`."""

from __future__ import annotations

import importlib

import pytest
from django.db import connection

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
