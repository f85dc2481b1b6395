"""A handler thread whose database session the server ended gets a fresh one before its
next job (issue 34), with a real worker process and a real pg_terminate_backend."""

from __future__ import annotations

import pytest
from django.db import connection

from jobs import services
from jobs.models import WorkerProcess
from tests.conftest import job_row
from tests.harness import wait_until
from tests.test_prefetch_e2e import TASKS, _calls

pytestmark = pytest.mark.slow


def test_a_handler_thread_replaces_a_session_the_server_ended(stack):
    """The backend of a busy handler thread is terminated while its handler works; the
    next job on that thread (one thread) uses the ORM and succeeds on a new session."""
    w = stack.worker("--concurrency", "1", "--queues", "st-session", JOBS_TASK_MODULES=TASKS)
    wait_until(lambda: WorkerProcess.objects.filter(pid=w.pid).exists(), 20, message="registered")
    first, _ = services.submit("e2e.record_call", {"seconds": 2}, queue="st-session",
                               max_retries=0)  # fmt: skip
    wait_until(lambda: _calls(first.pk) != [], 15, interval=0.02, message="first job running")
    with connection.cursor() as cur:
        # The handler thread's session: the one whose last statement wrote the Effect.
        cur.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND query LIKE 'INSERT INTO \"demo_effect\"%%'"
        )
        assert [r[0] for r in cur.fetchall()] == [True]
    wait_until(lambda: job_row(first.pk)["status"] == "done", 15, message="first job done")
    second, _ = services.submit("e2e.record_call", {}, queue="st-session", max_retries=0)
    wait_until(lambda: job_row(second.pk)["status"] in ("done", "failed"), 15, message="second")
    assert job_row(second.pk)["status"] == "done", job_row(second.pk)["error"]
    assert _calls(second.pk) == [1]
