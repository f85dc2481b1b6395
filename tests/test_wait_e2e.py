"""Waiting for a job to end (issue 42.2): `GET /api/v1/jobs/{id}/?wait=SECONDS` and
`jobs.waiting.wait_for` answer when a real worker ends the job, woken by its
announcement; an end nobody announced is found by the bounded fallback poll."""

from __future__ import annotations

import threading
import time

import pytest
from rest_framework.test import APIClient

from jobs import services, waiting
from jobs.models import Client, Job, WorkerProcess
from tests.harness import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def api(transactional_db):
    _, token = Client.create_with_token("waiter")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


def test_wait_answers_as_the_job_ends(stack, api, settings):
    settings.JOBS_WAIT_POLL_SECONDS = 30.0  # only the announcement can answer in time
    stack.worker("--concurrency", "2")
    wait_until(lambda: WorkerProcess.objects.exists(), 30, message="the worker is up")
    job_id = api.post(
        "/api/v1/jobs/", {"task": "sleep", "payload": {"seconds": 2}}, format="json"
    ).json()["id"]
    asked = time.monotonic()
    answer = api.get(f"/api/v1/jobs/{job_id}/?wait=30")
    took = time.monotonic() - asked
    answered_at = time.time()

    assert answer.status_code == 200, answer.content
    assert (answer.json()["status"], answer["Jobs-Wait"]) == ("done", "ended")
    job = Job.objects.get(pk=job_id)
    assert 2.0 <= took, took
    # Within a second of the job's end (0.01-0.2 s on a quiet machine, 0.21 s seen at load
    # 7), and the 2 s sleep from its start: far short of the 30 s poll it is told from.
    assert answered_at - job.finished_at.timestamp() < 1.0
    ran = took - (job.started_at.timestamp() - (answered_at - took))
    assert 1.8 <= ran < 3.0, ran


def test_an_end_nobody_announced_is_found_by_the_fallback_poll(api, settings):
    settings.JOBS_WAIT_POLL_SECONDS = 0.5
    job = services.submit("echo", {}, client_id=Client.objects.get().pk)[0]  # no worker
    threading.Timer(0.5, services.cancel, ([job.pk], "staff:test")).start()
    asked = time.monotonic()
    answer = api.get(f"/api/v1/jobs/{job.pk}/?wait=20")
    took = time.monotonic() - asked
    assert (answer.json()["status"], answer["Jobs-Wait"]) == ("failed", "ended")
    assert 0.5 <= took < 2.0, took


def test_a_wait_that_times_out_answers_with_the_job_as_it_is(api):
    job = services.submit("echo", {}, client_id=Client.objects.get().pk)[0]
    asked = time.monotonic()
    answer = api.get(f"/api/v1/jobs/{job.pk}/?wait=0.4")
    assert 0.4 <= time.monotonic() - asked < 2.0
    assert (answer.json()["status"], answer["Jobs-Wait"]) == ("queued", "timeout")
    assert waiting.wait_for(job.pk, 0.2).status == "queued"


@pytest.mark.parametrize("wait", ["-1", "abc", "nan", "61", "31", "inf"])
def test_a_wait_out_of_range_is_a_400(api, wait):
    job = services.submit("echo", {}, client_id=Client.objects.get().pk)[0]
    answer = api.get(f"/api/v1/jobs/{job.pk}/?wait={wait}")
    assert answer.status_code == 400, answer.content
    assert "wait" in answer.content.decode()


def test_past_the_process_wait_slots_the_answer_is_immediate(api, settings):
    settings.JOBS_API_WAIT_SLOTS = 0
    job = services.submit("echo", {}, client_id=Client.objects.get().pk)[0]
    asked = time.monotonic()
    answer = api.get(f"/api/v1/jobs/{job.pk}/?wait=20")
    assert time.monotonic() - asked < 1.0
    assert (answer.status_code, answer["Jobs-Wait"]) == (200, "busy")
