"""The stack behind a real PgBouncer (Debian's 1.18, transaction mode): API, workers and
reaper reach PostgreSQL through the pooler; each worker's presence session goes straight
to the server (JOBS_DIRECT_DATABASE_URL), so a kill -9 is still recovered in seconds."""

from __future__ import annotations

import json
import urllib.request

import pytest

from harness.pgbouncer import PgBouncer, available
from jobs import selectors, services
from jobs.models import Client, JobEvent, WorkerProcess
from tests.conftest import job_row
from tests.harness import database_url, free_port, wait_until
from tests.runbook import run_check

# One group under `--dist loadgroup`: the module's PgBouncer starts once, not once on
# each worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("pgbouncer")]

TASKS = "demo.tasks,tests.e2e_tasks"  # e2e.hold
RECOVERY_BOUND = 6.0  # seconds from kill -9 to claimed elsewhere, as without the pooler


@pytest.fixture(scope="module")
def bouncer(django_db_setup, django_db_blocker):
    """One pgbouncer for the module, in front of the test database's server."""
    reason = available()
    if reason:
        pytest.skip(reason)
    with django_db_blocker.unblock():
        server = database_url()
    pooler = PgBouncer(server, pool_size=5).start()  # the shared server has 100 slots
    yield pooler
    pooler.stop()


@pytest.fixture
def pooled(stack, bouncer):
    """The stack's processes on the pooler; presence sessions direct to the server."""
    direct = database_url()
    stack.env.update(DATABASE_URL=bouncer.url(direct), JOBS_DIRECT_DATABASE_URL=direct)
    return stack


def _registered(pid: int) -> WorkerProcess | None:
    return WorkerProcess.objects.filter(pid=pid).first()


def test_kill_9_behind_pgbouncer_runs_the_job_elsewhere_within_seconds(pooled, bouncer, tmp_path):
    """Reaper and two workers through the pooler: the presence lock is held on a direct
    session (not a pooled one), and kill -9 of the job's owner → claimed by the other
    worker within RECOVERY_BOUND (database clock). The job runs until the test opens its
    gate: the checks in between take as long as the machine makes them."""
    pooled.reaper()
    workers = {}
    for _ in range(2):
        w = pooled.worker("--concurrency", "2", "--queues", "bounced", JOBS_TASK_MODULES=TASKS)
        workers[w.pid] = w
    rows = [wait_until(lambda p=pid: _registered(p), 30, message="registered") for pid in workers]
    assert all(r.lock_key is not None for r in rows)
    gate = tmp_path / "gate"
    job, _ = services.submit("e2e.hold", {"gate": str(gate)}, queue="bounced")
    owner = wait_until(lambda: job_row(job.pk)["owned_by"], 30, message="claimed")
    # The runbook's checks (docs/operations.md "Past one Postgres"): transaction mode, the
    # processes are the pooler's clients, each lock sits on a session of the worker's own.
    env = {**pooled.env, "PGBOUNCER_ADMIN_URL": bouncer.admin_url}
    assert run_check("pool-mode", env)
    assert int(run_check("pooled-clients", env)) > 0
    assert run_check("presence-direct", env) == "2 of 2"
    assert run_check("prepared", env) == "None"  # Debian's 1.18 would drop the connection
    assert job_row(job.pk)["owned_by"] == owner  # still running where it was claimed
    workers.pop(int(owner.split(":")[1])).kill()
    killed_at = selectors.db_now()

    def claims():
        return list(JobEvent.objects.filter(job_id=job.pk, to_status="processing").order_by("id"))

    wait_until(lambda: len(claims()) == 2, 30, interval=0.05, message="claimed again")
    again = claims()[1]
    took = (again.at - killed_at).total_seconds()
    print(f"behind pgbouncer: kill -9 -> claimed elsewhere {took:.2f}s")
    assert again.actor != f"worker:{owner}"
    assert JobEvent.objects.get(job_id=job.pk, actor="reaper").error.startswith("worker gone")
    assert took <= RECOVERY_BOUND, took
    assert int(run_check("worker-gone", env)) > 0
    gate.touch()
    wait_until(lambda: job_row(job.pk)["status"] == "done", 20, message="done")
    assert job_row(job.pk)["result"] == {"held_by": again.actor.removeprefix("worker:")}


def test_api_and_worker_through_pgbouncer(pooled, bouncer):
    """gunicorn and a worker on the pooler: POST, the worker's fenced writes, GET."""
    _, token = Client.create_with_token("pooled")
    port = free_port()
    pooled.api(port, WEB_CONCURRENCY="1")
    pooled.worker("--concurrency", "4")

    def call(method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}",
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    body = {"task": "echo"}
    ids = [call("POST", "/api/v1/jobs/", {**body, "payload": {"n": n}})["id"] for n in range(20)]
    assert call("GET", f"/api/v1/jobs/{ids[0]}/")["id"] == ids[0]  # read right after writing
    wait_until(
        lambda: all(call("GET", f"/api/v1/jobs/{i}/")["status"] == "done" for i in ids),
        30,
        message="all done through the pooler",
    )
    results = [call("GET", f"/api/v1/jobs/{i}/")["result"] for i in ids]
    assert results == [{"n": n} for n in range(20)]
    assert "prepared statement" not in pooled.logs()
