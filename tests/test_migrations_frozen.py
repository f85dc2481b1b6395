"""Migrations install frozen trigger SQL, never what the modules generate today (issue 34).

A migration that imported `jobs.lifecycle.guard_trigger_sql` or `jobs.graph.triggers_sql`
would install a later version than it was written for, and a change to the rules
would silently change what it installs. The newest frozen texts must equal what the
modules generate, so a change to the rules cannot ship without a migration."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from jobs import graph, lifecycle
from jobs.migrations import _triggers

MIGRATIONS = Path(__file__).resolve().parent.parent / "jobs" / "migrations"


def _live_sql_uses(source: str) -> list[str]:
    """Names ending in `sql` that the source takes from a `jobs` module other than
    `jobs.migrations`: imported (`from jobs.lifecycle import guard_trigger_sql`) or
    reached as an attribute (`jobs.graph.triggers_sql()`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jobs"):
            if not node.module.startswith("jobs.migrations"):
                found += [f"{node.module}.{a.name}" for a in node.names if a.name.endswith("sql")]
        elif isinstance(node, ast.Attribute) and node.attr.endswith("sql"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in {"jobs", "lifecycle", "graph"}:
                found.append(ast.unparse(node))
    return found


def test_no_migration_takes_live_trigger_sql():
    migrations = sorted(MIGRATIONS.glob("0*.py"))
    assert len(migrations) >= 13
    offenders = {p.name: uses for p in migrations if (uses := _live_sql_uses(p.read_text()))}
    assert offenders == {}, f"migrations must install frozen SQL (_triggers.py): {offenders}"


@pytest.mark.parametrize(
    "source",
    [
        "from jobs.lifecycle import guard_trigger_sql\n",
        "from jobs.graph import drop_triggers_sql, triggers_sql\n",
        "import jobs.lifecycle\nx = jobs.lifecycle.guard_trigger_sql('a', 'b')\n",
    ],
)
def test_the_check_catches_live_sql(source):
    assert _live_sql_uses(source)


def test_frozen_sql_is_no_live_sql():
    assert _live_sql_uses("from jobs.migrations._triggers import GUARD_0013\n") == []
    assert _live_sql_uses("import jobs.lifecycle\nx = jobs.lifecycle.Status['QUEUED']\n") == []


def _newest(prefix: str) -> str:
    names = sorted(n for n in vars(_triggers) if n.startswith(prefix))
    return getattr(_triggers, names[-1])


def test_the_newest_frozen_triggers_are_what_the_rules_generate():
    """A change to lifecycle.py or graph.py fails here until a new migration installs
    its SQL, frozen under a new name."""
    assert _newest("GUARD_") == lifecycle.guard_trigger_sql("jobs_job", "jobs_jobevent")
    assert _newest("WORKFLOW_TRIGGERS_") == graph.triggers_sql()
    assert _newest("DROP_WORKFLOW_TRIGGERS_") == graph.drop_triggers_sql()
    assert _triggers.DROP_GUARD == lifecycle.drop_trigger_sql("jobs_job")
