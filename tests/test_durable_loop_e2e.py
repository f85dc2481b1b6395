"""A durable loop that continues as new, through real workers killed with kill -9
(issue 45): a step and a 0-second durable sleep per iteration, continue_as_new every
EVERY iterations, finished runs pruned by the normal retention while it runs.

`make test` runs 400 iterations (every 100, 2 kills); `make durable-loop` the issue's
10,000 (every 500, 6 kills) and prints the figures."""

from __future__ import annotations

import os
import random
import time
from collections import Counter, defaultdict

import pytest
from django.db import connection
from django.db.models import Q

from jobs import services
from jobs.models import Job, JobStep
from tests.harness import wait_until

pytestmark = pytest.mark.slow

TASKS = "demo.tasks,tests.durable_tasks"
TOTAL = int(os.environ.get("DURABLE_LOOP_TOTAL", "400"))
EVERY = int(os.environ.get("DURABLE_LOOP_EVERY", "100"))
KILLS = int(os.environ.get("DURABLE_LOOP_KILLS", "2"))
RETAIN = 2.0  # seconds a finished run stays before the retention prunes it


def _step_table_bytes() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT pg_total_relation_size('jobs_jobstep')")
        return cur.fetchone()[0]


@pytest.mark.timeout(int(240 + TOTAL * 0.2))
def test_a_long_loop_continues_as_new_under_kill_9(stack, tmp_path):
    env = {"JOBS_TASK_MODULES": TASKS, "JOBS_LEASE_SECONDS": "4", "JOBS_PRESENCE_SECONDS": "0.5"}
    payload = {"dir": str(tmp_path), "total": TOTAL, "every": EVERY}
    first, _ = services.submit("durable.loop", payload, max_retries=10)
    chain = Q(chain_id=first.pk) | Q(pk=first.pk)
    bytes_before = _step_table_bytes()
    stack.reaper("--interval", "0.5", **env)
    workers = [stack.worker("--concurrency", "2", **env) for _ in range(2)]
    log = tmp_path / "loop-steps"
    committed: dict[tuple[int, str], int] = {}  # (run, step) -> the lease it committed under
    run_of: dict[int, int] = {}  # job id -> run number, as seen while it lived
    most_rows = most_rows_per_run = most_bytes = kills = 0
    kill_at = [TOTAL * (k + 1) // (KILLS + 1) for k in range(KILLS)]
    started = time.monotonic()
    deadline = started + 120 + TOTAL * 0.15
    while True:
        runs = list(Job.objects.filter(chain).values_list("id", "run_number", "status"))
        live = [r for r in runs if r[2] in ("queued", "processing")]
        assert len(live) <= 1, live  # never two runs live at once
        for job_id, number, _ in runs:
            assert run_of.setdefault(job_id, number or 1) == (number or 1)
        numbers = Counter(n or 1 for _, n, _ in runs)
        assert all(c == 1 for c in numbers.values()), numbers  # no run duplicated
        steps = JobStep.objects.filter(job_id__in=[r[0] for r in runs])
        per_run = Counter()
        for job_id, name, lease_version in steps.values_list("job_id", "name", "lease_version"):
            per_run[job_id] += 1
            if not name.startswith("~"):
                committed[(job_id, name)] = lease_version
        most_rows = max(most_rows, JobStep.objects.count())
        most_rows_per_run = max([most_rows_per_run, *per_run.values()])
        most_bytes = max(most_bytes, _step_table_bytes())
        if not live:
            break
        services.prune_finished(RETAIN, ["done"], 1000)  # the normal retention, row-wise
        progress = len(log.read_text().splitlines()) if log.exists() else 0
        if kill_at and progress >= kill_at[0]:
            kill_at.pop(0)
            victim = workers.pop(random.randrange(len(workers)))
            victim.kill()  # SIGKILL mid-loop: no release, no write-back
            kills += 1
            workers.append(stack.worker("--concurrency", "2", **env))
        assert time.monotonic() < deadline, f"the loop stalled at {progress} of {TOTAL}"
        time.sleep(0.3)
    took = time.monotonic() - started

    last = Job.objects.get(pk=max(run_of))
    assert last.status == "done" and last.result["i"] == TOTAL
    assert last.run_number == TOTAL // EVERY and len(run_of) == TOTAL // EVERY
    assert last.previous_run_ids == sorted(run_of)[:-1]  # every run, in order, none lost
    assert most_rows_per_run <= min(1000, 2 * EVERY)  # each run's history within the bound

    lines = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    ran = defaultdict(list)
    for i, job_id, lease_version in lines:
        ran[(job_id, f"it-{i}")].append(lease_version)
    assert {int(name[3:]) for _, name in ran} == set(range(TOTAL))  # every iteration ran
    for key, leases in ran.items():
        assert key in committed, f"{key} ran but was never seen committed"
        # Runs under earlier leases are attempts whose checkpoint did not commit; none
        # after the committed one, and the committed lease ran it once.
        assert max(leases) == committed[key] and leases.count(committed[key]) == 1, key
    assert len(committed) == TOTAL

    wait_until(
        lambda: (
            services.prune_finished(RETAIN, ["done"], 1000) == 0
            and not JobStep.objects.filter(job_id__in=list(run_of)).exists()
        ),
        30,
        "every finished run pruned with its steps",
    )
    print(
        f"\ndurable loop: {TOTAL} iterations, continue_as_new every {EVERY}: "
        f"{len(run_of)} runs in {took:.1f} s ({TOTAL / took:.0f} iterations/s), "
        f"{kills} kill -9, {len(lines) - TOTAL} step re-runs of uncommitted checkpoints; "
        f"most step rows at once {most_rows} (per run {most_rows_per_run}); "
        f"jobs_jobstep {bytes_before / 1024:.0f} KiB before, at most {most_bytes / 1024:.0f} KiB"
        f" during, {_step_table_bytes() / 1024:.0f} KiB after"
    )
    if TOTAL // EVERY >= 10:  # bounded: far below what the whole loop wrote
        assert most_rows < TOTAL


def test_a_process_pool_child_continues_as_new_and_the_next_run_gets_the_signal(stack):
    """continue_as_new and its workflow check go through the child's channel to the
    parent's connection, as every fenced write of a process-pool attempt does."""
    env = {"JOBS_TASK_MODULES": TASKS}
    first, _ = services.submit("durable.chained_signal", {})
    stack.worker("--pool", "processes", "--concurrency", "1", **env)
    wait_until(
        lambda: Job.objects.filter(chain_id=first.pk, run_number=2, wait_reason="signal").exists(),
        60,
        "run 2 parked on its signal wait",
    )
    from jobs import signals

    assert signals.signal_job(first.pk, "go", {"via": "run 1's id"}) is True
    second = Job.objects.get(chain_id=first.pk, run_number=2)
    wait_until(lambda: Job.objects.get(pk=second.pk).status == "done", 60, "run 2 done")
    assert Job.objects.get(pk=second.pk).result == {"via": "run 1's id"}
    assert Job.objects.get(pk=first.pk).result == {"continued_as_new": second.pk}
