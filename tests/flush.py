"""The transactional tests' flush: only the tables a test wrote to, by DELETE (D367).

Django ends each `transactional_db` test (the end-to-end ones: their workers commit) with
`manage.py flush`: one TRUNCATE of every table, then the post_migrate signal, which
re-creates the content types, the permissions and the app's default queues and periodic
schedules. PostgreSQL gives every truncated table and index a new file, and a client or a
queue row cascades to the partitioned jobs table and its indexes, so that flush cost
0.2-0.6 s whatever the test wrote: 341 s of one `make test` summed over its 750
transactional tests.

Here the flush finds the tables holding a row (one query of EXISTS probes) and deletes
their rows in one transaction with `session_replication_role = replica`: no trigger runs
(the jobs table's guard refuses to delete a live job; a test may leave one) and no
foreign key is checked (every table that holds a row is emptied). Then post_migrate runs
as Django sends it. The content types and permissions are kept: only post_migrate writes
them, it adds what is missing, and ids that stay the same between tests are no test's
concern. What every test finds is what Django's flush leaves, but for dead row versions
that autovacuum takes.
"""

from __future__ import annotations

from django.core.management.sql import emit_post_migrate_signal
from django.db import connections, transaction
from django.test import TransactionTestCase

KEPT = frozenset({"django_content_type", "auth_permission"})


def written_tables(connection) -> list[str]:
    """The tables Django's flush would empty that hold at least one row."""
    names = [
        name
        for name in connection.introspection.django_table_names(
            only_existing=True, include_views=False
        )
        if name not in KEPT
    ]
    if not names:
        return []
    quote = connection.ops.quote_name
    probes = " UNION ALL ".join(
        f"SELECT %s WHERE EXISTS (SELECT 1 FROM {quote(name)})" for name in names
    )
    with connection.cursor() as cur:
        cur.execute(probes, names)
        return [row[0] for row in cur.fetchall()]


def flush(db_name: str) -> None:
    connection = connections[db_name]
    with transaction.atomic(using=db_name):
        tables = written_tables(connection)
        if tables:
            quote = connection.ops.quote_name
            with connection.cursor() as cur:
                cur.execute("SET LOCAL session_replication_role = replica")
                for t in tables:
                    cur.execute(f"DELETE FROM {quote(t)}")
    emit_post_migrate_signal(verbosity=0, interactive=False, db=db_name)


def _fixture_teardown(self: TransactionTestCase) -> None:
    if self.available_apps is not None or self.serialized_rollback:
        return _django_fixture_teardown(self)  # Django's own rules for those cases
    for db_name in self._databases_names(include_mirrors=False):
        flush(db_name)


_django_fixture_teardown = TransactionTestCase._fixture_teardown


def install() -> None:
    TransactionTestCase._fixture_teardown = _fixture_teardown
