"""A handler's result or error that PostgreSQL cannot store must fail that job, not
the worker (found by reasoning over the fault suite's write-back path).

Before the fix, a non-JSON result raised TypeError in the flusher thread and killed
it, and a NUL character made every write-back of its batch fail forever: the worker
kept claiming jobs and never wrote any back, so they ended only through the reaper.
"""

from __future__ import annotations

import pytest

from jobs import services
from jobs.models import Job
from tests.conftest import job_row
from tests.harness import wait_until

pytestmark = pytest.mark.slow

POISON = [
    ("e2e.unserializable", "invalid result: not JSON-serializable"),
    ("e2e.nan", "invalid result: not JSON-serializable"),
    ("e2e.nul_result", "invalid result: contains a NUL character"),
    ("e2e.unserializable_tx", "invalid result: not JSON-serializable"),
]


def test_unstorable_results_and_errors_fail_their_job_and_the_worker_goes_on(stack):
    poison = {name: services.submit(name, {})[0].pk for name, _ in POISON}
    nul_error = services.submit("e2e.nul_error", {}, max_retries=1)[0].pk
    echoes = [services.submit("echo", {"n": i})[0].pk for i in range(5)]
    stack.worker(
        "--concurrency", "1",
        JOBS_TASK_MODULES="demo.tasks,tests.e2e_tasks", JOBS_RETRY_BACKOFF_BASE="0.05",
    )  # fmt: skip
    ids = [*poison.values(), nul_error, *echoes]
    wait_until(
        lambda: Job.objects.filter(pk__in=ids, status__in=["done", "failed"]).count() == len(ids),
        30,
        message="every job written back by the one worker (no reaper runs)",
    )
    for name, error in POISON:
        row = job_row(poison[name])
        assert (row["status"], row["retry_count"]) == ("failed", 0), name
        assert row["error"].startswith(error), (name, row["error"])
    row = job_row(nul_error)
    assert (row["status"], row["retry_count"]) == ("failed", 2)  # retryable: budget spent
    assert row["error"] == "ValueError: bad\\x00byte"
    assert set(Job.objects.filter(pk__in=echoes).values_list("status", flat=True)) == {"done"}
