"""Step checkpoints under crashes and stale workers, with real worker processes."""

from __future__ import annotations

import signal

import pytest

from jobs import services
from jobs.models import JobEvent, JobStep
from tests.conftest import job_row
from tests.durable_tasks import runs
from tests.harness import wait_until

pytestmark = pytest.mark.slow

TASKS = "demo.tasks,tests.durable_tasks"


def test_kill_9_during_step_4_reruns_only_step_4(stack, tmp_path):
    """Steps 1-3 ran exactly once, step 4 at least once, step 5 once; done with all five."""
    job, _ = services.submit(
        "durable.five_steps", {"dir": str(tmp_path), "hang_step": 4, "hang": 60}, max_retries=3
    )
    env = {"JOBS_TASK_MODULES": TASKS, "JOBS_LEASE_SECONDS": "4", "JOBS_PRESENCE_SECONDS": "0.5"}
    victim = stack.worker("--concurrency", "1", **env)
    wait_until(lambda: runs(str(tmp_path), "step4") == 1, 60, "step 4 started")
    assert JobStep.objects.filter(job_id=job.pk).count() == 3  # 1-3 committed
    victim.kill()  # SIGKILL: no release, no write-back
    stack.reaper("--interval", "0.5", **env)
    stack.worker("--concurrency", "1", **env)
    wait_until(lambda: job_row(job.pk)["status"] == "done", 60, "job done after recovery")
    counts = [runs(str(tmp_path), f"step{n}") for n in range(1, 6)]
    assert counts[:3] == [1, 1, 1] and counts[3] >= 1 and counts[4] == 1, counts
    assert counts[3] == 2  # the killed run and the recovering one
    row = job_row(job.pk)
    assert row["result"] == {f"s{n}": {"step": n, "run": 2 if n == 4 else 1} for n in range(1, 6)}
    steps = JobStep.objects.filter(job_id=job.pk).order_by("id")
    assert [s.name for s in steps] == ["s1", "s2", "s3", "s4", "s5"]
    # Steps 1-3 under the first lease, 4-5 under the recovering one.
    assert [s.lease_version for s in steps] == [1, 1, 1, 3, 3]


def test_stale_worker_cannot_write_a_checkpoint(stack, tmp_path):
    """SIGSTOP past the lease; another worker finishes the job; the resumed one's
    checkpoint is refused: the step rows are unchanged and a rejection is recorded."""
    job, _ = services.submit(
        "durable.five_steps", {"dir": str(tmp_path), "hang_step": 2, "hang": 4}, max_retries=3
    )
    env = {"JOBS_TASK_MODULES": TASKS, "JOBS_LEASE_SECONDS": "2"}
    stale = stack.worker("--concurrency", "1", **env)
    wait_until(lambda: runs(str(tmp_path), "step2") == 1, 60, "step 2 started")
    stale.signal(signal.SIGSTOP)
    stack.reaper("--interval", "0.3", **env)
    wait_until(lambda: job_row(job.pk)["lease_version"] >= 2, 30, "lease expired")
    stack.worker("--concurrency", "1", **env)
    wait_until(lambda: job_row(job.pk)["status"] == "done", 60, "done by the other worker")
    before = list(JobStep.objects.filter(job_id=job.pk).values_list("id", "name", "result"))
    assert len(before) == 5
    stale.signal(signal.SIGCONT)  # its step 2 returns after the hang, and tries to checkpoint
    wait_until(
        lambda: JobEvent.objects.filter(job_id=job.pk, kind="fence_rejected").exists(),
        30,
        "the stale checkpoint refused and recorded",
    )
    rejected = JobEvent.objects.get(job_id=job.pk, kind="fence_rejected")
    assert "stale step rejected" in rejected.error and rejected.lease_version == 1
    after = list(JobStep.objects.filter(job_id=job.pk).values_list("id", "name", "result"))
    assert after == before
    assert runs(str(tmp_path), "step2") == 2 and runs(str(tmp_path), "step3") == 1
    assert job_row(job.pk)["status"] == "done"
