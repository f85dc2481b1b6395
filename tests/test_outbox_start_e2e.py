"""Completion events of jobs that finished before any reaper ran (issue 39), with real
processes: the API (jobservice.serve), runworker, runreaper started late and killed -9,
a real receiver on 127.0.0.1, the Redis stream, and the Kafka sink on a Tansu broker.

Each test starts from a database whose dispatcher never ran: no cursor rows at all
(what a new database was before migration 0024, and what the test database is after
the previous test's flush). Before the fix, the reaper's first tick placed each cursor
at the present and every one of these events was skipped.
"""

from __future__ import annotations

import io
import json
import time
import urllib.request
from collections import Counter

import pytest
import redis
from django.conf import settings
from django.core.management import call_command
from standardwebhooks.webhooks import Webhook as Verifier

from harness import Processes, service_env
from jobs.events import signing
from jobs.lifecycle import TERMINAL
from jobs.models import Client, Job, JobEvent, WebhookDelivery
from tests.factories import raw
from tests.harness import database_url, free_port, wait_until
from tests.scrape import port_scrape
from tests.test_webhooks_e2e import Receiver

# One group under `--dist loadgroup`: the module's API server
# starts once, not once on each worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("outbox_start")]

JOBS = 200
ENV = {
    "JOBS_WEBHOOK_ALLOW_PRIVATE": "1",
    "JOBS_OUTBOX_INTERVAL": "0.1",
    "JOBS_RETRY_BACKOFF_BASE": "0.05",
    "JOBS_RETRY_BACKOFF_MAX": "0.5",
    "JOBS_WEBHOOK_ENDPOINT_CONCURRENCY": "16",
    "JOBS_WEBHOOK_CIRCUIT_FAILURES": "0",
}


def received(receiver: Receiver) -> Counter[str]:
    """How often each message id was acknowledged (2xx in time, signature valid)."""
    with receiver.lock:
        return Counter(m for m, _, _, valid, ok in receiver.log if ok and valid)


class Api:
    def __init__(self, port: int, token: str) -> None:
        self.port, self.token = port, token

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
            method="POST",
            headers={"Authorization": f"Token {self.token}",
                     "Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())


def stream_ids() -> Counter[str]:
    """Every `id` field on the Redis stream `<prefix>events`, with how often."""
    r = redis.Redis.from_url(settings.REDIS_URL)
    entries = r.xrange(f"{settings.JOBS_REDIS_PREFIX}events")
    return Counter(fields[b"id"].decode() for _, fields in entries)


def terminal_events(job_ids: list[int]) -> set[str]:
    ids = JobEvent.objects.filter(job_id__in=job_ids, kind=JobEvent.TRANSITION,
                                  to_status__in=TERMINAL).values_list("id", flat=True)  # fmt: skip
    return {signing.message_id(i) for i in ids}


@pytest.fixture(scope="module")
def api_port(django_db_setup, tmp_path_factory):
    """The API server, for the module: it holds no state of a test's (the token is the
    test's), and its start cost each test's setup 5-20 s on a loaded machine."""
    env = service_env(database_url(), settings.REDIS_URL, settings.JOBS_REDIS_PREFIX,
                      "demo.tasks", **ENV)  # fmt: skip
    procs = Processes(tmp_path_factory.mktemp("api"), env)
    port = free_port()
    try:
        procs.api(port)
        yield port
    finally:
        procs.close()


@pytest.fixture
def deployment(stack, api_port):
    """A database whose dispatcher never ran; API and two workers up, no reaper; a
    client with a webhook (done and failed) registered through the API."""
    raw("DELETE FROM jobs_outboxcursor")
    redis.Redis.from_url(settings.REDIS_URL).delete(f"{settings.JOBS_REDIS_PREFIX}events")
    stack.env.update(ENV)
    receiver = Receiver(signing.secret_for(signing.new_salt()), mode="ok")  # until registered
    _, token = Client.create_with_token("late-reaper")
    api = Api(api_port, token)
    hook = api.post("/api/v1/webhooks/", {"url": receiver.url,
                                         "events": ["job.done", "job.failed"]})  # fmt: skip
    receiver.verifier = Verifier(hook["secret"])
    stack.worker("--concurrency", "8", "--webhook-concurrency", "2")
    stack.worker("--concurrency", "8", "--webhook-concurrency", "2")
    yield stack, api, receiver
    receiver.close()


def finish_without_a_reaper(api: Api, n: int) -> list[int]:
    """n jobs through the batch endpoint, a fifth failing for good; back once all ended."""
    job_ids: list[int] = []
    for start in range(0, n, 100):
        jobs = [{"task": "demo.permanent" if i % 5 == 0 else "echo", "payload": {"n": i}}
                for i in range(start, min(n, start + 100))]  # fmt: skip
        job_ids += [j["id"] for j in api.post("/api/v1/jobs/batch/", {"jobs": jobs})["jobs"]]
    wait_until(lambda: not Job.objects.filter(pk__in=job_ids).exclude(status__in=TERMINAL)
               .exists(), 120, "every job finished", interval=0.2)  # fmt: skip
    assert Job.objects.filter(pk__in=job_ids, status="failed").count() == n // 5
    assert not WebhookDelivery.objects.exists()  # no reaper: nothing dispatched yet
    assert raw("SELECT count(*) FROM jobs_outboxcursor")[0][0] == 0
    return job_ids


def every_event_arrived(receiver: Receiver, expected: set[str]):
    def check() -> bool:
        return expected <= set(received(receiver)) and expected <= set(stream_ids())

    return check


def test_jobs_finished_before_the_reaper_started_reach_webhook_and_stream_once(deployment):
    stack, api, receiver = deployment
    job_ids = finish_without_a_reaper(api, JOBS)
    expected = terminal_events(job_ids)
    assert len(expected) == JOBS
    stack.reaper("--interval", "1")
    wait_until(every_event_arrived(receiver, expected), 120,
               "every terminal event on the webhook and the stream", interval=0.2)  # fmt: skip
    time.sleep(2)  # a repeat would come within the next ticks and delivery attempts
    got, stream = received(receiver), stream_ids()
    assert all(valid for _, _, _, valid, _ in receiver.log), "a signature did not verify"
    assert {m: got[m] for m in expected} == dict.fromkeys(expected, 1)  # none twice
    assert {m: stream[m] for m in expected} == dict.fromkeys(expected, 1)
    assert set(got) == expected  # and nothing else: the client's events only
    print(f"{JOBS} jobs finished before the reaper: {len(expected)} terminal events "
          "delivered and streamed once each")  # fmt: skip


def test_a_reaper_killed_mid_stream_and_restarted_loses_and_repeats_nothing(deployment):
    """The deliveries go out 10 at a time (a queue bound on the reaper): the reaper is
    killed -9 while some were delivered and others still held, then restarted."""
    stack, api, receiver = deployment
    job_ids = finish_without_a_reaper(api, JOBS)
    expected = terminal_events(job_ids)
    reaper_env = {"JOBS_MAX_QUEUE_DEPTH": "10"}
    first = stack.reaper("--interval", "1", **reaper_env)
    wait_until(lambda: 20 <= len(received(receiver)), 60, "deliveries under way",
               interval=0.02)  # fmt: skip
    first.kill()
    delivered = len(received(receiver))
    held = WebhookDelivery.objects.filter(job__isnull=True).count()
    print(f"reaper killed -9 with {delivered} delivered, {held} deliveries held")
    assert held > 0, "the kill came after the last release: not mid-stream"
    stack.reaper("--interval", "1", **reaper_env)
    wait_until(every_event_arrived(receiver, expected), 120,
               "every terminal event on the webhook and the stream", interval=0.2)  # fmt: skip
    time.sleep(2)
    got, stream = received(receiver), stream_ids()
    assert {m: got[m] for m in expected} == dict.fromkeys(expected, 1)
    # A batch whose XADDs ran as the reaper died is sent again by the next (its cursor
    # had not moved); the stream's tail keeps it from being added twice.
    assert {m: stream[m] for m in expected} == dict.fromkeys(expected, 1)


def test_a_new_kafka_sink_waits_for_the_operator_and_starts_where_told(stack, broker):
    """Jobs finished before the sink was configured: the relay relays nothing, says so
    (log, jobs_outbox_not_started) until `outbox start`; from the beginning, every
    earlier event reaches the topic; the domain events' cursor, not started, waits."""
    raw("DELETE FROM jobs_outboxcursor")
    topic = "jobs.events.outbox-start"
    broker.create_topic(topic, partitions=3)
    stack.env.update(ENV)
    stack.worker("--concurrency", "8")
    from jobs import services

    job_ids = [s.job_id for s in services.submit_many(
        [services.NewJob("echo", {"n": i}) for i in range(30)])]  # fmt: skip
    wait_until(lambda: Job.objects.filter(pk__in=job_ids, status="done").count() == 30, 60,
               "the jobs done")  # fmt: skip
    port = free_port()
    reaper = stack.reaper("--interval", "1", "--metrics-port", str(port),
                          JOBS_KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap,
                          JOBS_KAFKA_TOPIC=topic)  # fmt: skip

    def not_started(name: str) -> float | None:
        try:
            series = port_scrape(port).series("jobs_outbox_not_started")
        except OSError:  # the metrics server not up yet
            return None
        found = [v for labels, v in series if labels.get("subscriber") == name]
        return found[0] if found else None

    wait_until(lambda: not_started("kafka") == 1.0, 60, "the sink shown not started")
    wait_until(lambda: "outbox subscriber kafka is not started" in reaper.output(), 30,
               "the refusal logged")  # fmt: skip
    assert raw("SELECT count(*) FROM jobs_outboxcursor WHERE name LIKE 'kafka%%'")[0][0] == 0
    assert broker.read(topic, expect=0, timeout=2) == []
    call_command("outbox", "start", "kafka", "--from", "beginning", stdout=io.StringIO())
    want = {signing.message_id(i) for i in JobEvent.objects.filter(
        job_id__in=job_ids, kind=JobEvent.TRANSITION).values_list("id", flat=True)}  # fmt: skip
    got = broker.read(topic, expect=len(want), timeout=60)
    assert want <= {m.event_id for m in got}
    wait_until(lambda: not_started("kafka") == 0.0, 30, "the sink shown started")
    assert not_started("kafka.domain") == 1.0
