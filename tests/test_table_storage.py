"""Migration 0004: storage settings on jobs_job, and its reverse. Since 0021 the table
is jobs_job_hot, the partition every live job is in (a partitioned parent has no
storage of its own); a cold partition is written once and keeps the defaults (D180,
D181)."""

from __future__ import annotations

import importlib
from datetime import date

import pytest
from django.db import transaction

from jobs import partitions
from tests.factories import raw

storage = importlib.import_module("jobs.migrations.0004_jobs_table_storage")
FORWARD = storage.FORWARD.replace("jobs_job", "jobs_job_hot")
REVERSE = storage.REVERSE.replace("jobs_job", "jobs_job_hot")


def reloptions(table: str = "jobs_job_hot") -> dict[str, str]:
    (opts,) = raw("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", [table])[0]
    return dict(o.split("=", 1) for o in opts or [])


@pytest.mark.django_db
def test_jobs_table_has_fillfactor_and_autovacuum_settings():
    assert reloptions() == {
        "fillfactor": "70",
        "autovacuum_vacuum_scale_factor": "0.02",
        "autovacuum_analyze_scale_factor": "0.01",
        "autovacuum_vacuum_cost_limit": "2000",
    }


@pytest.mark.django_db
def test_reverse_restores_the_defaults():
    class Rollback(Exception):
        pass

    with pytest.raises(Rollback), transaction.atomic():
        raw(REVERSE)
        assert reloptions() == {}
        raw(FORWARD)
        assert reloptions()["fillfactor"] == "70"
        raw(REVERSE)
        assert reloptions() == {}
        raise Rollback
    assert reloptions()["fillfactor"] == "70"


@pytest.mark.django_db
def test_a_cold_partition_keeps_the_defaults():
    """The mover writes a cold partition's rows once and nothing updates them: free room
    on its pages would be waste (fillfactor 100), and insert-only tables need no
    aggressive vacuum."""
    start = partitions.period_start(date(2020, 3, 4))
    assert (partitions.JOBS, start) in partitions.ensure({partitions.JOBS: {start}})
    assert reloptions(partitions.partition_name(partitions.JOBS, start)) == {}
    assert raw("SELECT relkind FROM pg_class WHERE relname = 'jobs_job'")[0][0] == "p"
