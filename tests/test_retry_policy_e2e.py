"""A task's own retry policy (issue 42.4), run by a real runworker: `retry_on` errors
retry with the task's backoff, any other fails at once, and each decision (the delay
and why) is in the job's history."""

from __future__ import annotations

import pytest

from jobs import services
from jobs.models import Job, JobEvent
from tests.harness import wait_until

pytestmark = pytest.mark.slow

# The global backoff is made long: a retry due within a second came from the policy.
ENV = {"JOBS_TASK_MODULES": "demo.tasks,tests.retry_tasks", "JOBS_RETRY_BACKOFF_BASE": "30"}


def _history(job_id: int) -> list[JobEvent]:
    return list(JobEvent.objects.filter(job_id=job_id).order_by("id"))


def test_retry_on_retries_with_its_own_backoff_and_other_errors_fail_at_once(stack):
    timeout = services.submit("retry.timeouts", {"raise": "timeout"}, max_retries=2)[0]
    value = services.submit("retry.timeouts", {"raise": "value"}, max_retries=2)[0]
    refused = services.submit("retry.timeouts", {"raise": "refused"}, max_retries=2)[0]
    stack.worker("--concurrency", "2", **ENV)
    ids = [timeout.pk, value.pk, refused.pk]
    wait_until(
        lambda: Job.objects.filter(pk__in=ids, status="failed").count() == 3,
        30,
        message="all three jobs failed",
    )

    # TimeoutError: retried twice, after 0.3 s then 0.5 s (min(0.5, 0.3 × 2)), then failed.
    job = Job.objects.get(pk=timeout.pk)
    assert (job.retry_count, job.error_class) == (3, "builtins.TimeoutError")  # budget spent
    events = _history(timeout.pk)
    decisions = [e for e in events if e.kind == JobEvent.RETRY_POLICY]
    assert [(d.to_status, d.error) for d in decisions] == [
        ("queued", "retry 1 in 0.300s (TimeoutError: retry_on; "
                   "min(0.5, 0.3×2^0) = 0.3s, jitter 0); run_at in 0.300s"),
        ("queued", "retry 2 in 0.500s (TimeoutError: retry_on; "
                   "min(0.5, 0.3×2^1) = 0.5s, jitter 0); run_at in 0.500s"),
        ("failed", "no retry: the budget of 2 retries is spent"),
    ]  # fmt: skip
    # Each retry was claimed no sooner than its delay after the failure that chose it.
    transitions = [e for e in events if e.kind == JobEvent.TRANSITION]
    retried = [e for e in transitions if (e.from_status, e.to_status) == ("processing", "queued")]
    claims = [e for e in transitions if e.to_status == "processing"]
    assert len(retried) == 2 and len(claims) == 3
    for fail_event, claim, delay in zip(retried, claims[1:], (0.3, 0.5), strict=True):
        gap = (claim.at - fail_event.at).total_seconds()
        assert delay <= gap < delay + 10, (gap, delay)  # never the global 30 s backoff

    # ValueError is not in retry_on: failed at the first attempt, no retry spent.
    job = Job.objects.get(pk=value.pk)
    assert (job.retry_count, job.error_class) == (0, "builtins.ValueError")
    assert [e.error for e in _history(value.pk) if e.kind == JobEvent.RETRY_POLICY] == [
        "no retry: ValueError is not in retry_on"
    ]
    assert [(e.from_status, e.to_status) for e in _history(value.pk) if e.kind == "transition"] == [
        (None, "queued"), ("queued", "processing"), ("processing", "failed"),
    ]  # fmt: skip

    # give_up_on wins at once too.
    job = Job.objects.get(pk=refused.pk)
    assert job.retry_count == 0
    assert [e.error for e in _history(refused.pk) if e.kind == JobEvent.RETRY_POLICY] == [
        "no retry: ConnectionRefusedError is in give_up_on"
    ]
