"""One result or error text PostgreSQL cannot store fails its own job only (issue 13.1).

Before the fix, a lone surrogate in a result or an error, or a NUL in an
InvalidPayload message, made the batched write-back fail with a data error that
was retried forever as if PostgreSQL were down: the worker wrote nothing back
and every job it held was left to the reaper.
"""

from __future__ import annotations

import time

import pytest

from jobs import services
from jobs.models import Job, JobEvent
from tests.conftest import job_row
from tests.harness import wait_until

pytestmark = pytest.mark.slow

# task -> (error the job ends with, retry_count): the retryable one has no budget left.
POISON = {
    "e2e.surrogate_result": ("invalid result: not valid UTF-8 (lone surrogate \\udce9)", 0),
    "e2e.surrogate_error": ("ValueError: cannot decode caf\\udce9", 1),
    "e2e.nul_invalid_payload": ("invalid payload: a\\x00b", 0),
}


def test_three_poison_jobs_among_500_fail_alone_and_the_rest_land_at_once(stack):
    items = [services.NewJob("echo", {"n": n}) for n in range(500)]
    for at, name in zip((100, 250, 400), POISON, strict=True):
        items.insert(at, services.NewJob(name, {}, max_retries=0))
    submitted = services.submit_many(items)
    ids = [s.job_id for s in submitted]
    poison = {s.task: s.job_id for s in submitted if s.task in POISON}
    # A short lease and a busy reaper: a stuck write-back would show up as reaped jobs.
    env = {"JOBS_TASK_MODULES": "demo.tasks,tests.e2e_tasks", "JOBS_LEASE_SECONDS": "5"}
    started = time.monotonic()
    stack.worker("--concurrency", "4", **env)
    stack.reaper("--interval", "0.5", "--lease", "5", **env)
    wait_until(
        lambda: Job.objects.filter(pk__in=ids, status__in=["done", "failed"]).count() == len(ids),
        40,
        interval=0.2,
        message="every job written back by the one worker",
    )
    elapsed = time.monotonic() - started
    print(f"\n503 jobs terminal {elapsed:.1f}s after the worker started")
    for name, (error, retries) in POISON.items():
        row = job_row(poison[name])
        assert (row["status"], row["retry_count"], row["error"]) == ("failed", retries, error)
    echoes = [i for i in ids if i not in poison.values()]
    assert Job.objects.filter(pk__in=echoes, status="done").count() == 500
    assert not JobEvent.objects.filter(error__startswith="lease expired").exists()
    assert not JobEvent.objects.filter(actor="reaper").exists()
    assert elapsed < 30  # seconds, not a lease plus a sweep per poison job
