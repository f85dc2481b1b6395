"""Sequences under real workers (issue 46.4): three worker processes, 100 jobs of one
key with random durations run strictly one at a time in submission order (read from
the jobs' history, on the database's clock); a failure halts the key, and a resume runs
the failed job again and then the rest, in order."""

from __future__ import annotations

import random

import pytest

from jobs import services
from jobs.flow import sequences
from jobs.models import Job, JobEvent
from tests.harness import wait_until

pytestmark = pytest.mark.slow

ENV = {"JOBS_TASK_MODULES": "demo.tasks,tests.e2e_tasks"}
N = 100


def _attempts(ids: list[int]) -> dict[int, list[tuple]]:
    """Per job, each attempt as (claimed at, ended at) from its history."""
    events = JobEvent.objects.filter(job_id__in=ids, kind="transition").order_by("id")
    out: dict[int, list[list]] = {i: [] for i in ids}
    for e in events:
        if e.to_status == "processing":
            out[e.job_id].append([e.at, None])
        elif e.from_status == "processing" and out[e.job_id]:
            out[e.job_id][-1][1] = e.at
    return {i: [tuple(a) for a in attempts] for i, attempts in out.items()}


def assert_serial_in_order(ids: list[int]) -> None:
    """No two attempts of the sequence overlap, and they start in submission order."""
    spans = sorted(
        (start, end, job_id, ids.index(job_id))
        for job_id, attempts in _attempts(ids).items()
        for start, end in attempts
    )
    assert all(end is not None for _, end, _, _ in spans)
    for before, after in zip(spans, spans[1:], strict=False):
        assert before[1] <= after[0], f"job {after[2]} started before job {before[2]} ended"
        assert before[3] <= after[3], f"job {after[2]} ran before job {before[2]}"


def test_three_workers_run_one_key_serially_in_order_and_a_failure_halts(stack, tmp_path):
    gate = tmp_path / "gate"
    gate.touch()
    rng = random.Random(46)
    failing = 60
    items = [
        services.NewJob(
            "e2e.sequence_step",
            {"i": i, "seconds": rng.uniform(0, 0.03),
             **({"gate": str(gate)} if i == failing else {})},
            max_retries=0,
            sequence_key="ledger",
        )
        for i in range(N)
    ]  # fmt: skip
    ids = [s.job_id for s in services.submit_many(items)]
    # Other keys run beside it all along.
    others = [s.job_id for s in services.submit_many(
        [services.NewJob("echo", {"i": i}, sequence_key=f"k{i}") for i in range(10)])]  # fmt: skip
    for _ in range(3):
        stack.worker("--concurrency", "4", **ENV)
    stack.reaper(**ENV)

    wait_until(lambda: Job.objects.filter(pk=ids[failing], status="failed").exists(), 120,
               "the gated job to fail")  # fmt: skip
    wait_until(lambda: Job.objects.filter(pk__in=others, status="done").count() == 10, 60,
               "the other keys' jobs")  # fmt: skip
    assert Job.objects.filter(pk__in=ids[:failing], status="done").count() == failing
    later = Job.objects.filter(pk__in=ids[failing + 1 :])
    assert {(j.status, j.wait_reason) for j in later} == {("queued", "sequence_halted")}
    assert not JobEvent.objects.filter(job_id__in=ids[failing + 1 :], to_status="processing")
    assert sequences.detail(None, "ledger").state == "halted"

    gate.unlink()
    assert sequences.resume(None, "ledger", "staff:test") == ids[failing]
    wait_until(lambda: Job.objects.filter(pk__in=ids, status="done").count() == N, 120,
               "the rest of the sequence")  # fmt: skip
    assert_serial_in_order(ids)
    assert sequences.detail(None, "ledger").state == "idle"
