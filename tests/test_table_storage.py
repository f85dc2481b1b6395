"""Migration 0004: storage settings on jobs_job, and its reverse."""

from __future__ import annotations

import importlib

import pytest
from django.db import transaction

from tests.factories import raw

storage = importlib.import_module("jobs.migrations.0004_jobs_table_storage")


def reloptions() -> dict[str, str]:
    (opts,) = raw("SELECT reloptions FROM pg_class WHERE oid = 'jobs_job'::regclass")[0]
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
        raw(storage.REVERSE)
        assert reloptions() == {}
        raw(storage.FORWARD)
        assert reloptions()["fillfactor"] == "70"
        raw(storage.REVERSE)
        assert reloptions() == {}
        raise Rollback
    assert reloptions()["fillfactor"] == "70"
