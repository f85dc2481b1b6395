"""A handler's result or error that PostgreSQL cannot store must fail that job, not
the worker (found by reasoning over the fault suite's write-back path).

Before the fix, a non-JSON result raised TypeError in the flusher thread and killed
it, and a NUL character made every write-back of its batch fail forever: the worker
kept claiming jobs and never wrote any back, so they ended only through the reaper.
"""

from __future__ import annotations

import pytest

from jobs import services
from jobs.models import Job, JobEvent
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


def test_a_transactional_job_finishes_when_its_final_write_is_made(stack):
    """finished_at and the done event use the statement's clock, not the start of the
    handler's transaction (`now()`), which made such jobs look as fast as a claim."""
    job = services.submit("e2e.slow_tx", {"seconds": 1.5})[0]
    stack.worker("--concurrency", "1", JOBS_TASK_MODULES="demo.tasks,tests.e2e_tasks")
    wait_until(lambda: job_row(job.pk)["status"] == "done", 30, message="done")
    row = job_row(job.pk)
    claimed = JobEvent.objects.get(job_id=job.pk, to_status="processing")
    done = JobEvent.objects.get(job_id=job.pk, to_status="done")
    ran = (row["finished_at"] - claimed.at).total_seconds()
    print(f"\nclaim to finished_at: {ran:.2f}s for a 1.5 s transactional handler")
    assert ran >= 1.4
    assert done.at == row["finished_at"] == row["updated_at"]
