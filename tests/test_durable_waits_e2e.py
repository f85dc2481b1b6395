"""Durable waits with real worker processes: a parked job frees its slot, sleeps and
signal waits resume it, a timeout is raised, an early signal is kept."""

from __future__ import annotations

import time

import pytest
from rest_framework.test import APIClient

from jobs import services, signals
from jobs.models import Client, JobEvent, JobStep
from tests.conftest import job_row
from tests.durable_tasks import runs
from tests.harness import wait_until

pytestmark = pytest.mark.slow

ENV = {"JOBS_TASK_MODULES": "demo.tasks,tests.durable_tasks", "JOBS_LEASE_SECONDS": "6"}


def test_sleep_frees_the_slot_and_resumes_after_the_sleep(stack, tmp_path):
    sleeper, _ = services.submit("durable.sleeper", {"dir": str(tmp_path), "seconds": 3})
    stack.worker("--concurrency", "1", "--poll-interval", "0.2", **ENV)
    stack.reaper("--interval", "0.5", **ENV)
    wait_until(lambda: job_row(sleeper.pk)["wait_reason"] == "sleep", 30, "parked")
    parked = job_row(sleeper.pk)
    assert (parked["status"], parked["retry_count"], parked["owned_by"]) == ("queued", 0, None)
    other, _ = services.submit("sleep", {"seconds": 1})  # holds the only slot for a second
    wait_until(lambda: job_row(other.pk)["status"] == "done", 20, "the other job ran meanwhile")
    assert job_row(sleeper.pk)["status"] == "queued"  # still asleep
    wait_until(lambda: job_row(sleeper.pk)["status"] == "done", 30, "resumed and done")
    row = job_row(sleeper.pk)
    slept = row["result"]["after"][1] - parked["run_at"].timestamp() + 3
    print(f"\nresumed {slept - 3:.2f}s after its wake-up time (slept {slept:.2f}s for 3 s)")
    assert slept >= 3 and slept < 3 + 10
    assert runs(str(tmp_path), "before") == 1 and runs(str(tmp_path), "after") == 1
    assert row["retry_count"] == 0
    other_done = job_row(other.pk)["finished_at"]
    assert other_done < row["finished_at"]


def _api(token: str) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return api


def test_wait_for_signal_resumes_on_the_api_signal_with_its_payload(stack, tmp_path):
    client, token = Client.create_with_token("signaller")
    job, _ = services.submit("durable.approval", {"dir": str(tmp_path)}, client_id=client.pk)
    stack.worker("--concurrency", "1", "--poll-interval", "0.2", **ENV)
    wait_until(lambda: job_row(job.pk)["wait_reason"] == "signal", 30, "parked on the signal")
    assert job_row(job.pk)["wait_key"] == "approval"
    time.sleep(1)
    assert job_row(job.pk)["status"] == "queued"  # waits without holding the worker
    r = _api(token).post(f"/api/v1/jobs/{job.pk}/signal/",
                          {"key": "approval", "payload": {"by": "ana"}}, format="json")  # fmt: skip
    assert r.status_code == 202 and r.json()["woke"] is True, r.content
    wait_until(lambda: job_row(job.pk)["status"] == "done", 30, "resumed by the signal")
    assert job_row(job.pk)["result"] == {"approved": {"by": "ana"}, "prepare_runs": 1}


def test_wait_for_signal_times_out_when_none_comes(stack, tmp_path):
    job, _ = services.submit("durable.approval", {"dir": str(tmp_path), "timeout": 2})
    stack.worker("--concurrency", "1", "--poll-interval", "0.2", **ENV)
    stack.reaper("--interval", "0.5", **ENV)
    wait_until(lambda: job_row(job.pk)["status"] == "done", 30, "timed out and finished")
    result = job_row(job.pk)["result"]
    assert result["timed_out"] is True and result["class"] == "SignalTimeout"
    assert "'approval' did not arrive within 2" in result["error"]
    names = set(JobStep.objects.filter(job_id=job.pk).values_list("name", flat=True))
    assert names == {"prepare", "~wait:approval", "~signal:approval"}
    assert job_row(job.pk)["retry_count"] == 0
    # A late signal is refused: the job has finished.
    with pytest.raises(signals.SignalRefused):
        signals.signal_job(job.pk, "approval", {"late": True})


def test_a_signal_that_arrives_before_the_wait_is_kept_and_consumed(stack, tmp_path):
    job, _ = services.submit("durable.signal_after_step", {"dir": str(tmp_path)})
    stack.worker("--concurrency", "1", "--poll-interval", "0.2", **ENV)
    wait_until(lambda: job_row(job.pk)["status"] == "processing", 30, "running its first step")
    assert signals.signal_job(job.pk, "go", {"early": True}) is False  # kept, nobody woken
    (tmp_path / "gate").touch()
    wait_until(lambda: job_row(job.pk)["status"] == "done", 30, "done")
    assert job_row(job.pk)["result"] == {"early": True}
    # It never parked: one claim, one attempt.
    claims = JobEvent.objects.filter(job_id=job.pk, to_status="processing").count()
    assert claims == 1
