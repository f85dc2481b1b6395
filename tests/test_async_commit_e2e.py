"""Claims, start marks and heartbeats commit without waiting for the WAL flush (D246),
proved against a PostgreSQL server of the module's own stopped with
`pg_ctl stop -m immediate` (harness.pgserver).

The first test holds the WAL writer so a claim surely lies unflushed when the server
stops: the claim is lost, the job is queued again at its old lease_version, and every
write of the worker that held the lost lease is fenced off, even once another worker's
claim brings the row back to the same lease_version. The second stops the server in the
middle of a real drain (two runworker processes) and judges the end with the fault
suite's invariants: nothing lost, nothing done twice, no result under a stale lease.
"""

from __future__ import annotations

import json
import subprocess

import psycopg
import pytest
from django.conf import settings as dj_settings

from chaos import checks
from harness import Processes, manage, service_env, wait_until
from harness.pgserver import PostgresServer, available

pytestmark = pytest.mark.slow

DRAIN_JOBS = 2000


class Stack:
    def __init__(self, server: PostgresServer, env: dict[str, str]) -> None:
        self.server, self.env = server, env
        self.url = env["DATABASE_URL"]

    def python(self, code: str) -> dict:
        """`code` in a Django shell on the private server; the JSON it prints last."""
        out = subprocess.run(manage("shell", "-c", code), env=self.env, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    def row(self, job_id: int) -> tuple:
        with psycopg.connect(self.url, autocommit=True) as conn:
            return conn.execute(
                "SELECT status, lease_version, owned_by FROM jobs_job WHERE id = %s", [job_id]
            ).fetchone()

    def crash(self, hold_wal_writer: bool = False) -> None:
        """Stop PostgreSQL with `pg_ctl stop -m immediate` and start it again."""
        if hold_wal_writer:
            self.server.hold_wal_writer()
        self.server.stop_immediate()
        self.server.start()

    def violations(self, accepted: list[int]) -> dict[str, list]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            return {k: v for k, v in checks.run_all(conn, accepted).items() if v}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    reason = available()
    if reason:
        pytest.skip(reason)
    server = PostgresServer(PostgresServer.QUIET).start()
    try:
        env = service_env(server.createdb("jobs"), dj_settings.REDIS_URL,
                          dj_settings.JOBS_REDIS_PREFIX + "asynccommit:", "demo.tasks")  # fmt: skip
        top = Stack(server, env)
        out = subprocess.run(manage("migrate", "--noinput"), env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        top.logs = tmp_path_factory.mktemp("asynccommit")
        yield top
    finally:
        server.close()


_LEASE = """
from jobs import services
def lease(job_id, lv, worker):
    return services.Lease(job_id, lv, worker, 'echo', {}, 'default', 0, 3, None)
"""


def test_a_lost_claim_leaves_the_job_queued_and_fences_off_its_worker(stack):
    ids = stack.python(
        "import json; from jobs import services; "
        "print(json.dumps([services.submit('echo', {})[0].pk for _ in range(2)]))"
    )
    done, lost = ids
    # The WAL writer held: nothing flushes WAL but a synchronous commit. A claim whose
    # completion commits is flushed by it (WAL is one sequence); the last claim is not.
    stack.server.hold_wal_writer()
    claimed = stack.python(
        _LEASE
        + f"""
import json
a = services.claim_ids('w-old', [{done}])[0]
assert {done} in services.complete([(a, {{'ok': 1}})])
b = services.claim_ids('w-old', [{lost}])[0]
assert services.heartbeat([b]) and services.mark_started([b])
print(json.dumps({{'lv': b.lease_version}}))
"""
    )
    assert stack.row(lost) == ("processing", claimed["lv"], "w-old")
    stack.crash()

    assert stack.row(done)[0] == "done"  # a durable completion keeps its claim
    assert stack.row(lost) == ("queued", claimed["lv"] - 1, None)  # the claim is lost
    after = stack.python(
        _LEASE
        + f"""
import json
old = lease({lost}, {claimed["lv"]}, 'w-old')
out = {{'early': [services.complete([(old, 1)]) != {{}}, bool(services.heartbeat([old])),
                  bool(services.mark_started([old]))]}}
new = services.claim_ids('w-new', [{lost}])[0]
out['new_lv'] = new.lease_version
# The new claim brought the row back to the lost claim's lease_version: only the
# owner tells the stale lease from the live one.
out['late'] = [services.complete([(old, 1)]) != {{}}, bool(services.heartbeat([old])),
               bool(services.mark_started([old]))]
services.record_fence_rejections([old], 'complete')
out['live'] = {lost} in services.complete([(new, {{'by': 'w-new'}})])
print(json.dumps(out))
"""
    )
    assert after == {"early": [False] * 3, "new_lv": claimed["lv"], "late": [False] * 3,
                     "live": True}  # fmt: skip
    assert stack.row(lost) == ("done", claimed["lv"], None)
    assert stack.violations(ids) == {}


def test_an_immediate_stop_mid_drain_loses_nothing_and_runs_nothing_twice(stack):
    accepted = stack.python(
        "import json; from jobs import services; "
        f"jobs = services.submit_many([services.NewJob('demo.record', {{}})] * {DRAIN_JOBS}); "
        "print(json.dumps([s.job_id for s in jobs]))"
    )
    assert len(accepted) == DRAIN_JOBS

    def count(where: str) -> int:
        with psycopg.connect(stack.url, autocommit=True) as conn:
            sql = f"SELECT count(*) FROM jobs_job WHERE id = ANY(%s) AND {where}"
            return conn.execute(sql, [accepted]).fetchone()[0]

    procs = Processes(stack.logs, stack.env)
    try:
        for _ in range(2):
            procs.worker("--queues", "default", ready=True)
        procs.reaper()
        wait_until(lambda: count("status = 'done'") >= DRAIN_JOBS // 5, 120, "a fifth done")
        stack.crash()
        at_restart = count("status = 'done'")
        assert at_restart < DRAIN_JOBS, "the drain ended before the stop: nothing was tested"
        wait_until(lambda: count("status NOT IN ('done', 'failed')") == 0, 180,
                   "every job terminal after the restart", interval=0.5)  # fmt: skip
    finally:
        procs.close()
    assert count("status = 'done'") == DRAIN_JOBS
    with psycopg.connect(stack.url, autocommit=True) as conn:
        effects = conn.execute(
            "SELECT count(*), count(DISTINCT job_id) FROM demo_effect WHERE job_id = ANY(%s)",
            [accepted],
        ).fetchone()
    assert effects == (DRAIN_JOBS, DRAIN_JOBS)  # each handler's committed effect once
    assert stack.violations(accepted) == {}
