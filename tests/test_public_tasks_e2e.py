"""Nobody stops the service from outside (SPEC §12, D196): the deployment's API server
and a real runworker, with the demo app installed as it is in the deployment. A client
naming a test or example task (`demo.crash` kills its worker) is refused on every path
that creates jobs, so the worker never sees it: it keeps running another client's job,
which ends done without a retry spent. Only the task the operator named in
JOBS_PUBLIC_TASKS is open."""

from __future__ import annotations

import http.client
import json

import pytest

from jobs.models import Client, Job
from tests.harness import free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def call(port: int, token: str, method: str, path: str, body: object = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read() or b"null")
    finally:
        conn.close()


def test_a_client_cannot_submit_demo_crash_and_the_worker_keeps_running(stack):
    _, victim = Client.create_with_token("victim")
    _, attacker = Client.create_with_token("attacker")
    port = free_port()
    # The deployment's settings, with the one task an operator opened by name.
    stack.api(port, DJANGO_SETTINGS_MODULE="jobservice.settings", JOBS_PUBLIC_TASKS="sleep")
    worker = stack.worker("--concurrency", "2", ready=True, JOBS_PUBLIC_TASKS="sleep")
    status, running = call(port, victim, "POST", "/api/v1/jobs/",
                           {"task": "sleep", "payload": {"seconds": 2}})  # fmt: skip
    assert status == 201, running
    wait_until(lambda: Job.objects.get(pk=running["id"]).status == "processing", 30,
               "the victim's job to start")  # fmt: skip

    refused = {
        "single": ("/api/v1/jobs/", {"task": "demo.crash", "payload": {}}),
        "batch": ("/api/v1/jobs/batch/", {"jobs": [{"task": "demo.crash", "payload": {}}]}),
        "workflow": ("/api/v1/workflows/",
                     {"name": "w", "steps": [{"id": "a", "task": "demo.crash", "payload": {}}]}),
        "schedule": ("/api/v1/schedules/", {"name": "boom", "interval_seconds": 60,
                                            "task": "demo.crash", "payload": {}}),
        "built-in echo": ("/api/v1/jobs/", {"task": "echo", "payload": {}}),
        "built-in fail": ("/api/v1/jobs/", {"task": "fail", "payload": {}}),
        "demo.record": ("/api/v1/jobs/", {"task": "demo.record", "payload": {}}),
    }  # fmt: skip
    answers = {what: call(port, attacker, "POST", path, body) for what, (path, body)
               in refused.items()}  # fmt: skip
    for what, (status, body) in answers.items():
        assert status == 400, (what, status, body)
        codes = json.dumps(body)
        assert "unknown_task" in codes, (what, body)
        assert "demo.crash" not in body["detail"].split("known:")[-1], body  # never listed
        assert "echo" not in body["detail"].split("known:")[-1], body
    assert not Job.objects.filter(client__name="attacker").exists()

    done = wait_until(lambda: Job.objects.filter(pk=running["id"], status="done").first(), 30,
                      "the victim's job to finish")  # fmt: skip
    assert done.retry_count == 0, done.retry_count
    assert worker.alive() and worker.starts == 1, worker.output()[-2000:]
    assert "demo.crash" not in worker.output()
