"""A step's checkpoint waits for the WAL flush (D370), proved against a PostgreSQL server
of the module's own stopped with `pg_ctl stop -m immediate` (harness.pgserver), as
tests/test_async_commit_e2e.py proves what start marks and heartbeats may lose.

A checkpoint that did not wait would be lost with the unflushed WAL while its worker,
told it committed, goes on: the job's completion, written after the restart, would end
it done without the step (found by the second test when checkpoints committed
asynchronously). The first test holds the WAL writer: committed checkpoints survive the
stop. The second stops the server in the middle of a drain of five-step durable jobs
(two runworkers): every job ends done with its five steps stored and its result built
from them, no step ran again after its committed checkpoint, and the fault suite's
invariants hold.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import psycopg
import pytest

from chaos import checks
from harness import Processes, wait_until
from tests.test_async_commit_e2e import Stack as AsyncCommitStack
from tests.test_async_commit_e2e import private_stack

# One group under `--dist loadgroup`: the module's private PostgreSQL
# starts once, not once on each worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("durable_checkpoint_crash")]

DRAIN_JOBS = 600
# 5 steps of 8 ms on two workers of 4 threads: the drain takes several seconds, the stop
# lands mid-drain (at the default 8 threads and 4 ms it could end before the stop).
STEP_SECONDS = 0.008
THREADS = "4"
FAST = {"JOBS_LEASE_SECONDS": "4", "JOBS_PRESENCE_SECONDS": "0.5"}


class Stack(AsyncCommitStack):
    def one(self, sql: str, params: list) -> tuple:
        with psycopg.connect(self.url, autocommit=True) as conn:
            return conn.execute(sql, params).fetchone()

    def all(self, sql: str, params: list) -> list[tuple]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            return conn.execute(sql, params).fetchall()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from private_stack(tmp_path_factory, Stack, "asyncstep",
                             "demo.tasks,tests.durable_tasks", **FAST)  # fmt: skip


def _lease(job_id: int, lv: int) -> str:
    return (
        f"lease = services.Lease({job_id}, {lv}, 'w-1', 'durable.many_steps', {{}}, "
        "'default', 0, 3, None); "
    )


def _checkpoints(*names: str) -> str:
    return "".join(f"assert services.checkpoint_step(lease, {n!r}, '1'); " for n in names)


def _steps(stack: Stack, job_id: int) -> list[str]:
    rows = stack.all("SELECT name FROM jobs_jobstep WHERE job_id = %s ORDER BY id", [job_id])
    return [r[0] for r in rows]


def test_a_committed_checkpoint_survives_an_immediate_stop(stack):
    job_id, lv = stack.python(
        "import json; from jobs import services; "
        "job = services.submit('durable.many_steps', {'steps': 2})[0]; "
        "lease = services.claim_ids('w-1', [job.pk], start=0)[0]; "
        "print(json.dumps([job.pk, lease.lease_version]))"
    )
    stack.server.hold_wal_writer()  # nothing flushes WAL but a synchronous commit
    stack.python("from jobs import services; " + _lease(job_id, lv)
                 + _checkpoints("s0", "s1") + "print('[]')")  # fmt: skip
    stack.crash()

    assert _steps(stack, job_id) == ["s0", "s1"]
    status = "SELECT status, lease_version, owned_by FROM jobs_job WHERE id = %s"
    assert stack.one(status, [job_id]) == ("processing", lv, "w-1")
    landed = stack.python(
        "import json; from jobs import services; " + _lease(job_id, lv)
        + "print(json.dumps(list(services.complete([(lease, 2)]))))"
    )  # fmt: skip
    assert landed == [job_id]
    assert stack.one(status, [job_id]) == ("done", lv, None)
    with psycopg.connect(stack.url, autocommit=True) as conn:
        assert {k: v for k, v in checks.run_all(conn, [job_id]).items() if v} == {}


def _runs(path: Path) -> dict[tuple[int, str], list[int]]:
    """(job, step) -> the leases its function ran under, from the shared log."""
    runs: dict[tuple[int, str], list[int]] = defaultdict(list)
    for line in path.read_text().splitlines():
        job, step, lease = line.split()
        runs[(int(job), step)].append(int(lease))
    return runs


def test_an_immediate_stop_mid_drain_loses_no_step_of_a_finished_job(stack, tmp_path):
    payload = {"dir": str(tmp_path), "seconds": STEP_SECONDS}
    accepted = stack.python(
        "import json; from jobs import services; jobs = services.submit_many("
        f"[services.NewJob('durable.logged_steps', {payload!r})] * {DRAIN_JOBS}); "
        "print(json.dumps([s.job_id for s in jobs]))"
    )
    assert len(accepted) == DRAIN_JOBS

    def done_ids() -> set[int]:
        rows = stack.all("SELECT id FROM jobs_job WHERE id = ANY(%s) AND status = 'done'",
                         [accepted])  # fmt: skip
        return {r[0] for r in rows}

    procs = Processes(stack.logs, stack.env)
    try:
        for _ in range(2):
            procs.worker("--queues", "default", "--concurrency", THREADS, ready=True)
        procs.reaper("--interval", "0.5")
        wait_until(lambda: len(done_ids()) >= DRAIN_JOBS // 5, 120, "a fifth done")
        stack.crash()
        done_before = done_ids()  # the ends that were durable at the stop
        assert len(done_before) < DRAIN_JOBS, "the drain ended before the stop: nothing tested"
        wait_until(lambda: len(done_ids()) == DRAIN_JOBS, 180,
                   "every job done after the restart", interval=0.5)  # fmt: skip
    finally:
        procs.close()

    steps = defaultdict(dict)
    for job, name, result, lease in stack.all(
        "SELECT job_id, name, result, lease_version FROM jobs_jobstep WHERE job_id = ANY(%s)",
        [accepted],
    ):
        steps[job][name] = (result, lease)
    results = dict(stack.all("SELECT id, result FROM jobs_job WHERE id = ANY(%s)", [accepted]))
    runs = _runs(tmp_path / "step-runs")
    names = [f"s{n}" for n in range(1, 6)]
    for job in accepted:
        assert sorted(steps[job]) == names, job  # no finished job lost a step
        assert results[job] == [steps[job][n][0] for n in names], job  # built from them
        for n in names:
            leases = runs[(job, n)]
            committed = steps[job][n][1]
            # No run after the committed checkpoint: every run's lease is at most its own.
            assert max(leases) == committed, (job, n, leases, committed)
    again = sum(len(v) - 1 for v in runs.values())
    print(f"\n{DRAIN_JOBS} jobs, {len(done_before)} done at the stop, {again} step runs again")
    with psycopg.connect(stack.url, autocommit=True) as conn:
        assert {k: v for k, v in checks.run_all(conn, accepted).items() if v} == {}
