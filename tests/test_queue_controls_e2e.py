"""Queue controls across real worker processes (issue 19, docs/queue-controls.md).

Every limit is checked against PostgreSQL itself: the table sampled while the workers
race, or the history the trigger writes. Workers are real `runworker` processes on
the shared Redis; JOBS_QUEUES gives them the controls, which they sync at start.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection

from jobs import services
from jobs.models import Job, Queue
from tests.harness import wait_until

pytestmark = pytest.mark.slow


def _declare(**queues: dict) -> dict[str, str]:
    """The workers' JOBS_QUEUES: `default` (Django Tasks' queue must be declared) and these."""
    return {"JOBS_QUEUES": json.dumps({"default": {}, **queues})}


class Sampler(threading.Thread):
    """Counts processing rows of a queue every `every` seconds on its own connection."""

    def __init__(self, queue: str, every: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.queue, self.every = queue, every
        self.samples: list = []
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                with connection.cursor() as cur:
                    self.samples.append(self.sample(cur))
                self.halt.wait(self.every)
        finally:
            connection.close()

    def sample(self, cur) -> Any:
        cur.execute(
            "SELECT count(*) FROM jobs_job WHERE queue = %s AND status = 'processing'",
            [self.queue],
        )
        return cur.fetchone()[0]

    def stop(self) -> list:
        self.halt.set()
        self.join(10)
        return self.samples


def _submit(queue: str, n: int, seconds: float) -> list[int]:
    items = [services.NewJob("sleep", {"seconds": seconds}, queue=queue) for _ in range(n)]
    return [s.job_id for s in services.submit_many(items)]


def _all_done(ids: list[int]) -> bool:
    return Job.objects.filter(pk__in=ids, status="done").count() == len(ids)


def _starts(queue: str) -> list:
    """When each job of `queue` started (its queued → processing events), in order."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT e.at FROM jobs_jobevent e JOIN jobs_job j ON j.id = e.job_id "
            "WHERE j.queue = %s AND e.to_status = 'processing' AND e.kind = 'transition' "
            "ORDER BY e.at",
            [queue],
        )
        return [r[0] for r in cur.fetchall()]


def _busiest_window(starts: list, seconds: float) -> int:
    """The most starts in any window (t - seconds, t] (closed at the newest start)."""
    width = timedelta(seconds=seconds)
    best, lo = 0, 0
    for hi, at in enumerate(starts):
        while starts[lo] <= at - width:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def test_three_workers_never_run_more_than_the_cap(stack):
    """Three workers of 8 threads, a queue capped at 2, 60 jobs of 0.5 s: the table,
    sampled every 50 ms, never holds more than 2 processing; the run takes about
    60 × 0.5 / 2 = 15 s (bounded generously: the machine is shared)."""
    env = _declare(capped={"concurrency": 2})
    for _ in range(3):
        stack.worker("--queues", "capped", "--concurrency", "8", ready=True, **env)
    assert Queue.objects.get(name="capped").concurrency == 2  # seeded by the workers
    sampler = Sampler("capped")
    sampler.start()
    started = time.monotonic()
    ids = _submit("capped", 60, 0.5)
    wait_until(lambda: _all_done(ids), 120, "60 capped jobs done", interval=0.2)
    took = time.monotonic() - started
    samples = sampler.stop()
    print(
        f"cap 2: 60 x 0.5 s done in {took:.1f}s (ideal 15.0s); {len(samples)} samples, "
        f"peak {max(samples)}, share of samples at the cap {samples.count(2) / len(samples):.0%}"
    )
    assert len(samples) > 100
    assert max(samples) == 2, "the cap was exceeded" if max(samples) > 2 else "never at cap"
    assert 14.5 <= took <= 40


def test_rate_holds_in_every_window_across_workers(stack):
    """5/s with three workers: 50 jobs take at least 9 s, and no 1 s window of the
    history's starts holds more than 5."""
    env = _declare(limited={"rate": "5/s"})
    for _ in range(3):
        stack.worker("--queues", "limited", "--concurrency", "8", ready=True, **env)
    started = time.monotonic()
    ids = _submit("limited", 50, 0.0)
    wait_until(lambda: _all_done(ids), 120, "50 rate-limited jobs done", interval=0.2)
    took = time.monotonic() - started
    starts = _starts("limited")
    busiest = _busiest_window(starts, 1.0)
    span = (starts[-1] - starts[0]).total_seconds()
    print(
        f"rate 5/s: 50 jobs in {took:.1f}s, starts spread over {span:.2f}s, busiest 1 s: {busiest}"
    )
    assert len(starts) == 50
    assert busiest <= 5
    assert took >= 9 and span >= 9
    assert took <= 40  # the rate, not the workers, set the pace


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize(
    "controls,seconds",
    [
        pytest.param({"concurrency": 1}, 20.0, id="cap"),
        pytest.param({"rate": "1/h"}, 0.0, id="rate"),
    ],
)
def test_a_worker_blocked_by_the_controls_sleeps_instead_of_spinning(stack, controls, seconds):
    """One job holds the only slot (or used the hour's token); four more wait. The
    worker, with free threads and queued work it may not start, uses little CPU and
    starts nothing more."""
    env = _declare(tight=controls)
    worker = stack.worker("--queues", "tight", "--concurrency", "4", ready=True, **env)
    ids = _submit("tight", 5, seconds)
    wait_until(
        lambda: Job.objects.filter(pk__in=ids).exclude(status="queued").count() == 1,
        30,
        "the first job to start",
    )
    time.sleep(1.0)  # past the start-up and the first claim
    cpu = _cpu_seconds(worker.pid)
    time.sleep(5.0)
    used = _cpu_seconds(worker.pid) - cpu
    print(f"{controls}: worker CPU over 5 s blocked: {used:.2f}s")
    assert Job.objects.filter(pk__in=ids, status="queued").count() == 4
    assert used < 0.5, f"the blocked worker used {used:.2f}s of CPU in 5 s"


def _manage(stack, *args: str, **env: str) -> str:
    proc = stack.start(*args, **env)
    assert proc.wait(60) == 0, proc.output()
    return proc.output()


def test_paused_queue_keeps_jobs_queued_until_resumed(stack):
    """`queue pause`, 100 jobs submitted: they stay queued and nothing starts while the
    queue is paused (the history has no start); `queue resume`: all done."""
    env = _declare(held={})
    for _ in range(2):
        stack.worker("--queues", "held", "--concurrency", "8", ready=True, **env)
    assert "queue held paused" in _manage(stack, "queue", "pause", "held", **env)
    ids = _submit("held", 100, 0.0)
    time.sleep(4.0)  # several claim rounds and snapshot refreshes of both workers
    assert Job.objects.filter(pk__in=ids, status="queued").count() == 100
    assert _starts("held") == []
    with connection.cursor() as cur:
        cur.execute("SELECT statement_timestamp()")
        resumed_at = cur.fetchone()[0]
    assert "queue held resumed" in _manage(stack, "queue", "resume", "held", **env)
    wait_until(lambda: _all_done(ids), 60, "100 jobs done after resume", interval=0.2)
    assert min(_starts("held")) >= resumed_at


def _started_per_queue(queues_: list[str]) -> dict[str, int]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT j.queue, count(*) FROM jobs_jobevent e JOIN jobs_job j ON j.id = e.job_id "
            "WHERE j.queue = ANY(%s) AND e.to_status = 'processing' GROUP BY j.queue",
            [queues_],
        )
        return {q: 0 for q in queues_} | dict(cur.fetchall())


@pytest.mark.parametrize(
    "declared,served",
    [
        pytest.param({"wa": {"weight": 4}, "wb": {"weight": 1}}, "wa,wb", id="queue-model"),
        pytest.param({"wa": {}, "wb": {}}, "wa:4,wb", id="runworker-queues"),
    ],
)
def test_weights_share_claims_four_to_one_between_busy_queues(stack, declared, served):
    """Two queues that never run dry, weights 4:1 (from the Queue rows, or from
    --queues): of 2,500 starts, each queue's share is within ±15 % of 80 % / 20 %.
    A shortened run (about 10-20 s, not a minute): 2,500 claims already put the
    expected share's standard deviation below 1 %."""
    ids = _submit("wa", 4000, 0.0) + _submit("wb", 4000, 0.0)
    worker = stack.worker(
        "--queues", served, "--concurrency", "2", ready=True, **_declare(**declared)
    )
    wait_until(lambda: sum(_started_per_queue(["wa", "wb"]).values()) >= 2500, 120,
               "2,500 starts", interval=0.2)  # fmt: skip
    worker.kill()
    started = _started_per_queue(["wa", "wb"])
    left = Job.objects.filter(pk__in=ids, status="queued")
    assert left.filter(queue="wa").exists() and left.filter(queue="wb").exists()  # both busy
    share = started["wb"] / sum(started.values())
    print(f"{served}: {started} -> wb share {share:.3f} (expected 0.200)")
    assert 0.17 <= share <= 0.23


def test_a_low_weight_queue_is_not_starved_by_a_busy_one(stack):
    """Weights 10:1 and a backlog on the heavy queue that outlasts the test: the light
    queue's 20 jobs are all done while the heavy one still has work."""
    heavy = _submit("heavy", 6000, 0.0)
    light = _submit("light", 20, 0.0)
    env = _declare(heavy={"weight": 10}, light={"weight": 1})
    stack.worker("--queues", "heavy,light", "--concurrency", "2", ready=True, **env)
    wait_until(lambda: _all_done(light), 60, "the light queue's jobs done", interval=0.2)
    assert Job.objects.filter(pk__in=heavy, status="queued").exists()


def test_cap_holds_while_a_killed_workers_slots_are_recovered(stack):
    """kill -9 the worker holding both slots of a queue capped at 2: its jobs stay
    `processing` (so the cap still counts them) until the reaper takes them back, the
    survivor never runs more than 2, and every job ends done."""
    env = _declare(fragile={"concurrency": 2})
    stack.reaper("--interval", "0.5", **env)
    victim = stack.worker("--queues", "fragile", "--concurrency", "4", ready=True, **env)
    ids = _submit("fragile", 12, 1.0)
    wait_until(
        lambda: Job.objects.filter(pk__in=ids, status="processing").count() == 2,
        30,
        "the first worker to hold both slots",
    )
    sampler = Sampler("fragile")
    sampler.start()
    victim.kill()
    stack.worker("--queues", "fragile", "--concurrency", "4", ready=True, **env)
    wait_until(lambda: _all_done(ids), 120, "all jobs done after the crash", interval=0.2)
    samples = sampler.stop()
    print(f"cap 2 through a kill -9: peak {max(samples)} over {len(samples)} samples")
    assert max(samples) == 2
