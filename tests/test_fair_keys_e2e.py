"""Fair share and concurrency keys across real worker processes (issue 28).

Checked against PostgreSQL itself: the table sampled while the workers run, and the
history the trigger writes. The large run (20,000 jobs) is `python -m bench
--scenario fair-share`; this is its small, fast version.
"""

from __future__ import annotations

import json
import time

import pytest
from django.db import connection, transaction
from django.db.models import Max

from jobs import services
from jobs.models import Job, JobEvent, Queue, WorkerProcess
from tests.conftest import job_row
from tests.factories import ClientFactory
from tests.harness import wait_until
from tests.test_containment_e2e import MODULES
from tests.test_queue_controls_e2e import Sampler

pytestmark = pytest.mark.slow


def _declare(**queues: dict) -> dict[str, str]:
    return {"JOBS_QUEUES": json.dumps({"default": {}, **queues})}


def _submit(queue: str, n: int, task: str = "echo", payload=None, client=None, **fields):
    items = [services.NewJob(task, payload or {}, queue=queue, **fields) for _ in range(n)]
    ids = []
    for start in range(0, n, 1000):
        ids += [
            s.job_id
            for s in services.submit_many(
                items[start : start + 1000], client_id=client.pk if client else None
            )
        ]
    return ids


def _count(sql: str, params: list) -> int:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchone()[0]


class KeySampler(Sampler):
    """Every 20 ms: processing rows of the queue with the key, and with other keys."""

    def __init__(self, queue: str, key: str) -> None:
        super().__init__(queue, every=0.02)
        self.key = key

    def sample(self, cur) -> tuple[int, int]:
        cur.execute(
            "SELECT count(*) FILTER (WHERE concurrency_key = %s),"
            " count(*) FILTER (WHERE concurrency_key <> %s)"
            " FROM jobs_job WHERE queue = %s AND status = 'processing'",
            [self.key, self.key, self.queue],
        )
        return cur.fetchone()


def test_key_concurrency_one_never_runs_two_of_a_key_while_other_keys_run_alongside(stack):
    """key_concurrency 1, three workers of 4 threads: 30 jobs of 0.3 s with key `one`
    run one at a time (the table sampled every 20 ms, and the history's intervals never
    overlap), while 12 jobs with other keys run beside them."""
    env = _declare(keyed={"key_concurrency": 1})
    for _ in range(3):
        stack.worker("--queues", "keyed", "--concurrency", "4", ready=True, **env)
    assert Queue.objects.get(name="keyed").key_concurrency == 1
    sampler = KeySampler("keyed", "one")
    sampler.start()
    started = time.monotonic()
    one = _submit("keyed", 30, "sleep", {"seconds": 0.3}, concurrency_key="one")
    others = []
    for n in range(4):
        others += _submit("keyed", 3, "sleep", {"seconds": 0.3}, concurrency_key=f"other-{n}")
    wait_until(
        lambda: Job.objects.filter(pk__in=one + others, status="done").count() == 42,
        90,
        "42 keyed jobs done",
        interval=0.2,
    )
    took = time.monotonic() - started
    samples = sampler.stop()
    peak_one = max(s[0] for s in samples)
    alongside = sum(1 for s in samples if s[0] == 1 and s[1] >= 2)
    print(
        f"key_concurrency 1: 30 x 0.3 s of one key in {took:.1f}s (ideal 9.0s); "
        f"{len(samples)} samples, peak of the key {peak_one}, samples with >= 2 other "
        f"keys running beside it: {alongside}"
    )
    assert len(samples) > 100
    assert peak_one == 1
    assert alongside > 0, "other keys never ran alongside the capped key"
    # The history: each attempt of key `one` ended before the next began.
    with connection.cursor() as cur:
        cur.execute(
            "SELECT e.job_id, e.to_status, e.at FROM jobs_jobevent e"
            " WHERE e.job_id = ANY(%s) AND e.to_status IN ('processing', 'done')"
            " ORDER BY e.at, e.id",
            [one],
        )
        running = 0
        for _, to_status, _ in cur.fetchall():
            running += 1 if to_status == "processing" else -1
            assert running <= 1, "two jobs of key `one` were processing at once"
    assert took >= 9.0


def test_a_fair_queue_runs_a_late_clients_jobs_before_an_earlier_backlog(stack):
    """Client A queues 3,000 no-op jobs, then client B queues 20; one default worker
    starts: B's 20 are done while nearly all of A's backlog still waits (first in, first
    out would run them after every one of A's). Both are queued before the worker starts,
    so how fast the machine drains A decides nothing."""
    env = _declare(shared={"fair": True})
    a, b = ClientFactory.create(name="a"), ClientFactory.create(name="b")
    backlog = _submit("shared", 3000, client=a)
    late = _submit("shared", 20, client=b)
    started = time.monotonic()
    stack.worker("--queues", "shared", ready=True, **env)
    wait_until(
        lambda: Job.objects.filter(pk__in=late, status="done").count() == 20,
        30,
        "B's 20 done",
        interval=0.02,
    )
    took = time.monotonic() - started
    # From the database's own clock, not this process's polling: how many of A's jobs had
    # been claimed when B's last one finished. First in, first out: all 3,000.
    b_done = Job.objects.filter(pk__in=late).aggregate(at=Max("finished_at"))["at"]
    a_ahead = (
        JobEvent.objects.filter(job_id__in=backlog, to_status="processing", at__lte=b_done)
        .values("job_id")
        .distinct()
        .count()
    )
    print(f"fair: B's 20 done {took:.2f}s after the worker started; {a_ahead} of A's 3000 ahead")
    assert a_ahead < 1500, f"{a_ahead} of A's 3000 were claimed before B's last: B waited"
    wait_until(
        lambda: Job.objects.filter(pk__in=backlog, status="done").count() == 3000,
        120,
        "A's backlog done",
        interval=0.2,
    )


def test_a_fair_claim_marks_started_the_job_its_thread_runs(stack, tmp_path):
    """D211: one thread, a fair queue, one claim of two jobs on their last attempt: the
    first client's turn `first` (priority 0), then the next client's `urgent` (priority
    10). The job the claim marks started (D77) is the one whose handler runs, so after
    kill -9 the job that ran is charged and the other is put back unrun, no retry spent.
    (The claim marked `first` while the worker's heap ran `urgent`: `first` failed
    "worker gone" with its handler never called.)"""
    env = _declare(turns={"fair": True})
    warm_client, one, two = (ClientFactory.create(name=n) for n in ("warm", "one", "two"))
    stack.reaper()
    # No Redis: the worker claims by polling PostgreSQL, so two jobs committed together
    # come in one claim; a 60 s lease keeps them prefetched (not released) for 8 s.
    settings = dict(JOBS_LEASE_SECONDS="60", JOBS_TASK_MODULES=MODULES, REDIS_URL="", **env)
    w = stack.worker("--concurrency", "1", "--queues", "turns", ready=True, **settings)
    wait_until(lambda: WorkerProcess.objects.filter(pid=w.pid).exists(), 20, "registered")
    warm = _submit("turns", 3, client=warm_client)  # a run time measured: it prefetches
    wait_until(lambda: Job.objects.filter(pk__in=warm, status="done").count() == 3, 20, "warm")
    go = tmp_path / "go"
    calls = {"first": tmp_path / "first", "urgent": tmp_path / "urgent"}
    with transaction.atomic():
        ids = {
            name: services.submit(
                "contain.hold", {"calls": str(calls[name]), "go": str(go)}, queue="turns",
                client_id=client.pk, priority=priority, max_retries=0,
            )[0].pk
            for name, client, priority in (("first", one, 0), ("urgent", two, 10))
        }  # fmt: skip
    held = Job.objects.filter(pk__in=ids.values(), status="processing")
    wait_until(lambda: held.count() == 2, 15, "both claimed", interval=0.05)
    wait_until(lambda: any(p.exists() for p in calls.values()), 15, "a handler runs")
    ran = next(name for name, p in calls.items() if p.exists())
    unrun = "urgent" if ran == "first" else "first"
    wait_until(lambda: job_row(ids[ran])["started_at"] is not None, 10, "its start marked")
    assert job_row(ids[unrun])["started_at"] is None, f"{unrun} marked started, {ran} ran"
    w.kill()
    go.write_text("go")
    stack.worker("--concurrency", "2", "--queues", "turns", **settings)
    wait_until(lambda: job_row(ids[unrun])["status"] == "done", 30, f"{unrun} done")
    wait_until(lambda: job_row(ids[ran])["status"] == "failed", 30, f"{ran} charged")
    assert job_row(ids[ran])["error"].startswith("worker gone")
    assert job_row(ids[unrun])["retry_count"] == 0
    assert calls[unrun].read_text().splitlines() == ["1"]  # its handler called once
    assert calls[ran].read_text().splitlines() == ["1"]
    assert not JobEvent.objects.filter(job_id=ids[unrun], to_status="failed").exists()
