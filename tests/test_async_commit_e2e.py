"""Start marks and heartbeats commit without waiting for the WAL flush (D246), proved
against a PostgreSQL server of the module's own stopped with `pg_ctl stop -m immediate`
(harness.pgserver).

The first test holds the WAL writer so a start mark and a heartbeat surely lie unflushed
when the server stops: both are lost, the durable claim is not, and the attempt completes
under its lease. The second stops the server in the middle of a real drain (two
runworker processes) and judges the end with the fault suite's invariants: nothing lost,
nothing done twice, no result under a stale lease, each handler's effect once.
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

# One group under `--dist loadgroup`: the module's private PostgreSQL
# starts once, not once on each worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("async_commit")]

DRAIN_JOBS = 2000
# 20 ms each: two workers of 4 threads take ~5 s, so the stop lands mid-drain.
WORK = {"seconds": 0.02}


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

    def crash(self) -> None:
        """Stop PostgreSQL with `pg_ctl stop -m immediate` and start it again."""
        self.server.stop_immediate()
        self.server.start()

    def violations(self, accepted: list[int]) -> dict[str, list]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            return {k: v for k, v in checks.run_all(conn, accepted).items() if v}


def private_stack(factory, cls: type[Stack], name: str, tasks: str, **settings: str):
    """A Stack on a PostgreSQL server of its own, migrated (a module fixture's body)."""
    reason = available()
    if reason:
        pytest.skip(reason)
    server = PostgresServer(PostgresServer.QUIET).start()
    try:
        env = service_env(server.createdb("jobs"), dj_settings.REDIS_URL,
                          f"{dj_settings.JOBS_REDIS_PREFIX}{name}:", tasks, **settings)  # fmt: skip
        top = cls(server, env)
        out = subprocess.run(manage("migrate", "--noinput"), env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        top.logs = factory.mktemp(name)
        yield top
    finally:
        server.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from private_stack(tmp_path_factory, Stack, "asynccommit", "demo.tasks")


def _row(stack: Stack, job_id: int) -> tuple:
    with psycopg.connect(stack.url, autocommit=True) as conn:
        return conn.execute(
            "SELECT status, lease_version, owned_by, started_at IS NOT NULL, progress IS NOT NULL"
            " FROM jobs_job WHERE id = %s",
            [job_id],
        ).fetchone()


def test_a_lost_start_mark_and_heartbeat_leave_the_lease_held(stack):
    """The claim commits durably; the start mark and the heartbeat after it do not wait
    for the flush, so with the WAL writer held they die with the server, and the attempt
    still completes under its lease."""
    claimed = stack.python(
        "import json; from jobs import services; "
        "job = services.submit('echo', {})[0]; "
        "lease = services.claim_ids('w-1', [job.pk], start=0)[0]; "
        "print(json.dumps([job.pk, lease.lease_version]))"
    )
    job_id, lv = claimed
    assert _row(stack, job_id) == ("processing", lv, "w-1", False, False)
    stack.server.hold_wal_writer()  # nothing flushes WAL but a synchronous commit
    stack.python(
        "from jobs import services; "
        f"lease = services.Lease({job_id}, {lv}, 'w-1', 'echo', {{}}, 'default', 0, 3, None); "
        "assert services.mark_started([lease]); "
        "assert services.heartbeat([lease], [{'step': 1}]); print('[]')"
    )
    assert _row(stack, job_id) == ("processing", lv, "w-1", True, True)  # visible at once
    stack.crash()

    assert _row(stack, job_id) == ("processing", lv, "w-1", False, False)  # both lost
    landed = stack.python(
        "import json; from jobs import services; "
        f"lease = services.Lease({job_id}, {lv}, 'w-1', 'echo', {{}}, 'default', 0, 3, None); "
        "print(json.dumps(list(services.complete([(lease, {'ok': 1})]))))"
    )
    assert landed == [job_id]
    assert _row(stack, job_id)[:3] == ("done", lv, None)
    assert stack.violations([job_id]) == {}


def test_an_immediate_stop_mid_drain_loses_nothing_and_runs_nothing_twice(stack):
    accepted = stack.python(
        "import json; from jobs import services; "
        f"jobs = services.submit_many([services.NewJob('demo.record', {WORK})] * {DRAIN_JOBS}); "
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
            procs.worker("--queues", "default", "--concurrency", "4", ready=True)
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
