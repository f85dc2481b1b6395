"""Webhook deliveries contained, end to end (issue 27 item 4): a default `runworker` and a
`runreaper` as subprocesses, real receivers on 127.0.0.1.

Six receivers that trickle their answer one byte at a time (every 5 s, or every 0.25 s,
faster than any read timeout) must not delay another client's jobs (their own delivery
slots), and each attempt at them ends within JOBS_WEBHOOK_TIMEOUT + 1 s (read from the
delivery jobs' history). A receiver that
keeps failing opens its circuit: deliveries then wait without calling it and without
spending their budget, and once it answers again every event still arrives.
"""

from __future__ import annotations

import signal
import statistics
import time

import pytest
from django.db import connection

from jobs import services
from jobs.events import signing
from jobs.lifecycle import Status
from jobs.models import Client, Job, Webhook, WebhookDelivery
from tests.harness import wait_until
from tests.test_webhook_containment import Trickler
from tests.test_webhooks_e2e import dispatcher_started, receiver_and_hook

pytestmark = pytest.mark.slow

TIMEOUT = 2.0  # JOBS_WEBHOOK_TIMEOUT here: small, so the test stays short
ENV = {
    "JOBS_WEBHOOK_ALLOW_PRIVATE": "1",
    "JOBS_WEBHOOK_TIMEOUT": str(TIMEOUT),
    "JOBS_RETRY_BACKOFF_BASE": "0.05",
    "JOBS_RETRY_BACKOFF_MAX": "0.5",
    "JOBS_OUTBOX_INTERVAL": "0.1",
}

# Each attempt of a delivery job: from its move to processing to the next move of the job.
_ATTEMPTS_SQL = """
SELECT e.job_id, e.at, next.at, next.to_status, next.error
FROM jobs_jobevent e
JOIN LATERAL (SELECT n.at, n.to_status, n.error FROM jobs_jobevent n
              WHERE n.job_id = e.job_id AND n.id > e.id AND n.kind = 'transition'
              ORDER BY n.id LIMIT 1) next ON true
WHERE e.job_id = ANY(%s) AND e.kind = 'transition' AND e.to_status = 'processing'
"""


def attempts(job_ids: list[int]) -> list[tuple[int, float, str, str | None]]:
    with connection.cursor() as cur:
        cur.execute(_ATTEMPTS_SQL, [job_ids])
        return [(j, (end - start).total_seconds(), to, error)
                for j, start, end, to, error in cur.fetchall()]  # fmt: skip


def test_six_trickling_receivers_do_not_delay_another_clients_jobs(stack):
    slow = Client.objects.create(name="slow-receivers", token_hash="s" * 64)
    busy = Client.objects.create(name="busy", token_hash="b" * 64)
    stack.reaper("--interval", "1", **ENV)
    wait_until(dispatcher_started, 30, "the dispatcher's first tick")
    # A byte every 5 s (the receivers), and every 0.25 s: no read timeout ever fires.
    receivers = [Trickler(every) for every in (5.0, 5.0, 5.0, 0.25, 0.25, 0.25)]
    for r in receivers:
        Webhook.objects.create(client=slow, url=f"http://127.0.0.1:{r.port}/hook",
                               events=["job.done"], secret_salt=signing.new_salt())  # fmt: skip
    try:
        stack.worker(ready=True, **ENV)  # the default: --concurrency 4, default,webhooks
        services.submit_many([services.NewJob("echo", {"n": i}) for i in range(8)],
                             client_id=slow.pk)  # fmt: skip
        # Every delivery slot is taken by a trickler before the other client submits.
        wait_until(lambda: sum(r.sent > 0 for r in receivers) >= 4, 30, "tricklers called")
        echo: list[int] = []
        for batch in range(20):  # 200 jobs over ~4 s, while the tricklers hold their slots
            echo += [s.job_id for s in services.submit_many(
                [services.NewJob("echo", {"batch": batch, "n": i}) for i in range(10)],
                client_id=busy.pk)]  # fmt: skip
            time.sleep(0.2)
        wait_until(lambda: Job.objects.filter(pk__in=echo, status=Status.DONE).count() == 200,
                   60, "the echo jobs done", interval=0.2)  # fmt: skip
        latencies = sorted(
            (j.finished_at - j.created_at).total_seconds() for j in Job.objects.filter(pk__in=echo)
        )
        p99 = latencies[int(len(latencies) * 0.99) - 1]
        deliveries = list(
            WebhookDelivery.objects.exclude(job_id=None).values_list("job_id", flat=True)
        )
        seen = attempts(deliveries)
        called = [a for a in seen if a[3] and "within" in a[3]]  # ended by the deadline
        longest = max(s for _, s, _, _ in seen)
        print(f"echo submission→done: p50 {statistics.median(latencies):.3f}s p99 {p99:.3f}s; "
              f"{len(seen)} delivery attempts ({len(called)} cut at the deadline), longest "
              f"{longest:.2f}s; bytes trickled {[r.sent for r in receivers]}")  # fmt: skip
        assert p99 < 2.0
        assert len(called) >= 6  # the tricklers were really called and really cut
        assert longest <= TIMEOUT + 1
        assert all(Job.objects.get(pk=j).status != Status.DONE for j in deliveries)
    finally:
        for r in receivers:
            r.close()


def test_a_failing_receiver_opens_its_circuit_and_recovers_without_losing_an_event(stack):
    owner = Client.objects.create(name="down-then-up", token_hash="d" * 64)
    env = {**ENV, "JOBS_WEBHOOK_CIRCUIT_FAILURES": "3", "JOBS_WEBHOOK_CIRCUIT_OPEN_SECONDS": "2",
           "JOBS_WEBHOOK_CIRCUIT_MAX_OPEN_SECONDS": "3"}  # fmt: skip
    stack.reaper("--interval", "1", **env)
    wait_until(dispatcher_started, 30, "the dispatcher's first tick")
    receiver, hook = receiver_and_hook(owner, "down", events=["job.done"])
    try:
        stack.worker(ready=True, **env)
        items = [services.NewJob("echo", {"n": i}) for i in range(10)]
        jobs = [s.job_id for s in services.submit_many(items, client_id=owner.pk)]
        wait_until(lambda: Webhook.objects.get(pk=hook.pk).circuit_state == "open", 30,
                   "the circuit open", interval=0.1)  # fmt: skip
        calls_at_open = len(receiver.log)
        time.sleep(4)  # two open periods: each lets one probe through, and no other call
        calls = len(receiver.log) - calls_at_open
        print(f"{calls_at_open} calls before the circuit opened, {calls} in 4 s after")
        assert calls_at_open <= 3 + 1  # the threshold, plus one in flight on the other slot
        assert calls <= 3
        receiver.mode = "ok"
        wait_until(lambda: WebhookDelivery.objects.filter(job__status=Status.DONE).count() == 10,
                   60, "every delivery done", interval=0.2)  # fmt: skip
        hook.refresh_from_db()
        assert (hook.circuit_state, hook.circuit_failures) == ("closed", 0)
        assert {m for m, *_ in receiver.log} >= {
            signing.message_id(e) for e in done_events(jobs)}  # fmt: skip
        # Every call is a counted attempt; only calls spent a retry (the last one
        # succeeded); the attempts that found the circuit open ended without a call.
        rows = list(WebhookDelivery.objects.select_related("job"))
        assert len(rows) == 10 and sum(d.attempts for d in rows) == len(receiver.log)
        assert all(d.job.retry_count == d.attempts - 1 for d in rows)
        assert len(attempts([d.job_id for d in rows])) > len(receiver.log)
    finally:
        receiver.close()


def done_events(job_ids: list[int]) -> list[int]:
    from jobs.models import JobEvent

    return list(JobEvent.objects.filter(job_id__in=job_ids, to_status=Status.DONE)
                .values_list("id", flat=True))  # fmt: skip


def registered() -> list[tuple[str, list[str]]]:
    with connection.cursor() as cur:
        cur.execute("SELECT id, queues FROM jobs_worker ORDER BY id")
        return cur.fetchall()


def test_one_signal_stops_both_workers_and_burst_ends_both(stack):
    """The default runworker registers its job worker and its delivery worker; SIGTERM
    warm-stops both (a delivery in flight ends first) and the process exits 0, both
    unregistered. With --burst, the process ends once neither has work."""
    owner = Client.objects.create(name="stop", token_hash="x" * 64)
    receiver = Trickler(0.25)
    Webhook.objects.create(client=owner, url=f"http://127.0.0.1:{receiver.port}/hook",
                           events=["job.done"], secret_salt=signing.new_salt())  # fmt: skip
    stack.reaper("--interval", "1", **ENV)
    wait_until(dispatcher_started, 30, "the dispatcher's first tick")
    try:
        worker = stack.worker(ready=True, **ENV)
        wait_until(lambda: len(registered()) == 2, 30, "both workers registered")
        assert sorted(q for _, qs in registered() for q in qs) == ["default", "webhooks"]
        services.submit_many([services.NewJob("echo", {})], client_id=owner.pk)
        wait_until(lambda: receiver.sent > 0, 30, "a delivery in flight")
        signalled = time.monotonic()
        worker.signal(signal.SIGTERM)
        assert worker.wait(TIMEOUT + 10) == 0
        print(f"stopped {time.monotonic() - signalled:.1f}s after SIGTERM")
        assert registered() == []
        assert not Job.objects.filter(status=Status.PROCESSING).exists()
        Webhook.objects.all().delete()  # its delivery, requeued, now ends at once
        started = time.monotonic()
        burst = stack.worker("--burst", **ENV)
        assert burst.wait(30) == 0
        print(f"--burst exited after {time.monotonic() - started:.1f}s")
    finally:
        receiver.close()
