"""The schema's shapes the drain, the latency, drain-sinks and the HTTP submissions can
run on side by side (`--variant`): each applied to the scratch database's emptied tables
before its run, after the migrated shape is put back."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from bench.measure import sql
from jobs.migrations import _triggers


def _no_redundant() -> dict[str, str]:
    """The indexes migration 0031 dropped (D406), by name: read when a variant is applied,
    not when the bench is imported (table-growth imports it beside a tree before 0031)."""
    migration = importlib.import_module("jobs.migrations.0031_no_redundant_indexes")
    return {**migration.PLAIN, **migration.PARTITIONED}


# Database variants for side-by-side runs on the scratch database (--variant).
VARIANTS: dict[str, str | tuple[str, ...] | Callable[[], tuple[str, ...]]] = {
    "default": "",
    # The history trigger as it was before 0006: one trigger call per changed row.
    "row-history": _triggers.HISTORY_PER_ROW,
    # Without the storage settings of migration 0004 (fillfactor, autovacuum), for a
    # before/after of that migration; they are the hot partition's since 0021.
    "no-table-storage": (
        "ALTER TABLE jobs_job_hot RESET (fillfactor, autovacuum_vacuum_scale_factor, "
        "autovacuum_analyze_scale_factor, autovacuum_vacuum_cost_limit)",
        "VACUUM FULL jobs_job_hot",
    ),
    # The foreign keys' own indexes migration 0031 dropped (D406), built again.
    "redundant-indexes": lambda: tuple(
        f"CREATE INDEX IF NOT EXISTS {index} ON {on}" for index, on in _no_redundant().items()
    ),
}


def labelled(label: str, variant: str) -> str:
    """A result's code label, naming the variant it ran on (none for the default)."""
    return label if variant == "default" else f"{label} +{variant}"


def apply_variant(name: str) -> None:
    """Put back the migrated schema's history triggers and storage, then apply the variant."""
    from jobs.lifecycle import guard_trigger_sql

    sql(guard_trigger_sql("jobs_job", "jobs_jobevent"))
    sql("DROP TRIGGER IF EXISTS jobs_job_history ON jobs_job")
    storage = importlib.import_module("jobs.migrations.0004_jobs_table_storage").FORWARD
    sql(storage.replace("jobs_job", "jobs_job_hot"))  # the hot partition's since 0021
    for index in _no_redundant():  # as 0031 left them
        sql(f"DROP INDEX IF EXISTS {index}")
    statements = VARIANTS[name]
    if callable(statements):
        statements = statements()
    for statement in (statements,) if isinstance(statements, str) else statements:
        if statement:
            sql(statement)
    # The emptied tables as reset() leaves them whatever the variant did: an index built
    # on a truncated table notes it as empty (reltuples 0, not the unknown -1 TRUNCATE
    # leaves), and the planner's first choices in the run followed that (D406).
    sql("TRUNCATE jobs_job, jobs_jobevent")
