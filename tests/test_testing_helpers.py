"""jobs.testing.run_jobs: queued jobs run in the test's own transaction and thread."""

from __future__ import annotations

import time
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from jobs import services
from jobs.models import Job
from jobs.testing import run_jobs


@pytest.mark.django_db
def test_run_jobs_runs_a_job_inside_the_tests_transaction():
    job, _ = services.submit(task="echo", payload={"x": 1})
    started = time.monotonic()
    ran = run_jobs()
    assert time.monotonic() - started < 1
    assert [(r.job.pk, r.status, r.result, r.attempt) for r in ran] == [
        (job.pk, "done", {"x": 1}, 1)
    ]
    assert Job.objects.get(pk=job.pk).status == "done"


def _other_sessions() -> list[tuple]:
    """Sessions on the test database besides this thread's own."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT pid, application_name, state, left(query, 60) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return cur.fetchall()


@pytest.mark.django_db(transaction=True)
def test_runworker_burst_leaves_no_session_open_when_it_returns():
    job, _ = services.submit(task="echo", payload={"x": 2})
    call_command("runworker", burst=True, stdout=StringIO())
    assert Job.objects.get(pk=job.pk).status == "done"
    assert _other_sessions() == []


@pytest.mark.django_db
def test_runworker_inside_a_testcase_transaction_is_refused_at_once():
    services.submit(task="echo", payload={"x": 3})
    started = time.monotonic()
    with pytest.raises(CommandError, match="run_jobs"):
        call_command("runworker", burst=True, stdout=StringIO())
    assert time.monotonic() - started < 1
