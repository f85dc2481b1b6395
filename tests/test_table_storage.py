"""Migration 0004: storage settings on jobs_job, and its reverse. Since 0021 the table
is jobs_job_hot, the partition every live job is in (a partitioned parent has no
storage of its own)."""

from __future__ import annotations

import importlib

import pytest
from django.db import transaction

from tests.factories import raw

storage = importlib.import_module("jobs.migrations.0004_jobs_table_storage")
FORWARD = storage.FORWARD.replace("jobs_job", "jobs_job_hot")
REVERSE = storage.REVERSE.replace("jobs_job", "jobs_job_hot")


def reloptions() -> dict[str, str]:
    (opts,) = raw("SELECT reloptions FROM pg_class WHERE oid = 'jobs_job_hot'::regclass")[0]
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
