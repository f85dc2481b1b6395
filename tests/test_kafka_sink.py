"""The outbox's Kafka sink (issue 30) against a real broker (Tansu, started per module on
a free loopback port), driven in-process: what is produced, what a frozen broker does
to the cursor, the settings it refuses, and `manage.py kafka`.

The end-to-end guarantees with real runworker/runreaper processes are in
tests/test_kafka_e2e.py.
"""

from __future__ import annotations

import io
import itertools
import json
import threading
import time

import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction

from harness import database_url
from jobs import metrics, services
from jobs.events import kafka, publish, signing, subscriber
from jobs.events.lag import OutboxLagCollector, lag
from jobs.events.outbox import Dispatcher
from jobs.events.relay import WebhookFanout
from jobs.events.sources import SOURCES
from jobs.models import Client, DomainEvent, Job, JobEvent, Webhook, WebhookDelivery
from tests.factories import raw

pytestmark = pytest.mark.django_db(transaction=True)

_topics = itertools.count()


@pytest.fixture
def topic(broker, settings):
    """A fresh topic of 3 partitions per test, and the sink pointed at it."""
    name = f"jobs.events.t{next(_topics)}"
    broker.create_topic(name, partitions=3)
    settings.JOBS_KAFKA_BOOTSTRAP_SERVERS = broker.bootstrap
    settings.JOBS_KAFKA_TOPIC = name
    settings.JOBS_KAFKA_CONFIG = '{"linger.ms": 5}'
    return name


_sinks: list[kafka.KafkaSink] = []


@pytest.fixture(autouse=True)
def _close_sinks():
    yield
    while _sinks:
        _sinks.pop().close(0)


def sink(timeout: float = 10.0) -> kafka.KafkaSink:
    _sinks.append(kafka.KafkaSink(timeout=timeout))
    return _sinks[-1]


def relay(timeout: float = 10.0) -> Dispatcher:
    started("kafka")
    d = Dispatcher([sink(timeout)])
    d.tick()  # the first tick notes a horizon
    return d


def started(*names: str) -> None:
    """The sink starts where an operator says (D193): here, at the present."""
    call_command("outbox", "start", *names, "--from", "now", stdout=io.StringIO())


def drain(d: Dispatcher, rounds: int = 4) -> int:
    return sum(d.tick() for _ in range(rounds))


def cursor() -> int:
    return raw("SELECT last_id FROM jobs_outboxcursor WHERE name = 'kafka'")[0][0]


def history(job_ids: list[int]) -> dict[str, tuple[int, int, str]]:
    """evt id → (job id, seq, type) of every transition of these jobs."""
    rows = JobEvent.objects.filter(job_id__in=job_ids, kind=JobEvent.TRANSITION)
    return {signing.message_id(i): (j, s, signing.event_type(t))
            for i, j, s, t in rows.values_list("id", "job_id", "seq", "to_status")}  # fmt: skip


def run_jobs(n: int) -> list[int]:
    """n jobs through queued → processing → done, the odd ones failed instead."""
    ids = [s.job_id for s in services.submit_many([services.NewJob("echo", {"n": i})
                                                   for i in range(n)])]  # fmt: skip
    for job_id in ids:
        lease = services.claim("w1", job_id)
        if job_id % 2:
            services.fail([(lease, "boom", True)])
        else:
            services.complete([(lease, {"n": job_id})])
    return ids


def test_every_event_is_produced_keyed_by_job_with_its_id_and_type(broker, topic):
    d = relay()
    ids = run_jobs(10)
    assert drain(d) == 30
    want = history(ids)
    got = broker.read(topic, expect=30)
    assert len(got) == 30 and {m.event_id for m in got} == set(want)
    for m in got:
        job_id, seq, kind = want[m.event_id]
        assert m.key == str(job_id) and m.type == kind
        assert m.body["id"] == m.event_id and m.body["type"] == kind
        assert m.body["data"]["id"] == job_id and m.body["data"]["seq"] == seq
        assert set(m.body) == {"id", "type", "created_at", "data"}
    by_job: dict[int, list[tuple[int, int]]] = {}
    for m in got:
        by_job.setdefault(m.job_id, []).append((m.partition, m.seq))
    for job_id, placed in by_job.items():
        assert len({p for p, _ in placed}) == 1, f"job {job_id} spread over partitions"
        assert [s for _, s in placed] == [1, 2, 3]
    assert {m.type for m in got} == {"job.queued", "job.processing", "job.done", "job.failed"}
    assert cursor() == max(e.id for e in JobEvent.objects.filter(job_id__in=ids))


def test_the_same_body_as_the_stream_and_webhooks(broker, topic):
    """Value = the JSON the other subscribers send: one body, whichever sink."""
    client = Client.objects.create(name="k", token_hash="k" * 64)
    Webhook.objects.create(client=client, url="http://127.0.0.1:9/h", events=["*"],
                           secret_salt=signing.new_salt())  # fmt: skip
    started("kafka")
    d = Dispatcher([WebhookFanout(), sink()])
    d.tick()
    job, _ = services.submit("echo", {"x": 1}, client_id=client.pk)
    drain(d)
    # The delivery job's own events are outbox events too: read this job's.
    (message,) = [m for m in broker.read(topic, expect=2) if m.job_id == job.pk]
    (delivery,) = WebhookDelivery.objects.filter(source_job_id=job.pk)
    assert message.body == json.loads(delivery.body)


def test_a_burst_from_the_newest_open_transaction_reaches_the_topic_whole(broker, topic):
    """Issue 30: one transaction writes a burst of history and nothing commits after it
    began (its transaction id is then not in a snapshot's list of those in progress).
    The relay must wait for it rather than move past the burst's first ids."""
    d = relay()
    with psycopg.connect(database_url()) as burst:
        burst.execute(
            "INSERT INTO jobs_job (task, payload, queue, priority, run_at, max_retries, "
            "updated_by, status, retry_count, lease_version) SELECT 'echo', '{}', "
            "'default', 0, now(), 0, 'api', 'queued', 0, 0 FROM generate_series(1, 33)"
        )
        job_ids = [r[0] for r in burst.execute("SELECT id FROM jobs_job").fetchall()]
        (first,) = burst.execute("SELECT min(id) FROM jobs_jobevent").fetchone()
        assert drain(d) == 0
        assert cursor() < first  # not past ids whose transaction is open
        burst.commit()
    assert drain(d) == 33
    want = history(job_ids)
    got = broker.read(topic, expect=len(want))
    assert sorted(m.event_id for m in got) == sorted(want)


def test_a_frozen_broker_holds_the_cursor_and_loses_nothing(broker, topic):
    d = relay(timeout=1.0)
    ids = run_jobs(4)
    first = min(JobEvent.objects.filter(job_id__in=ids).values_list("id", flat=True))
    errors = metrics.KAFKA_ERRORS.labels(reason="not_acknowledged")
    before = errors._value.get()
    broker.freeze()
    try:
        assert drain(d, rounds=3) == 0
        assert cursor() < first  # nothing acknowledged: the position stays behind
        assert errors._value.get() >= before + 2
        (row,) = [r for r in lag() if r.subscriber == "kafka"]
        assert row.events == 12 and row.seconds > 0
    finally:
        broker.thaw()
    assert drain(d) == 12
    got = broker.read(topic, expect=12)
    assert {m.event_id for m in got} == set(history(ids))
    # What was in flight during the freeze was waited for, not produced a second time.
    assert len(got) == 12
    (row,) = [r for r in lag() if r.subscriber == "kafka"]
    assert row.events == 0 and row.seconds == 0


def test_a_relay_waiting_on_the_broker_never_holds_the_webhooks_back(broker, topic):
    """The Kafka tick holds an advisory lock, not a transaction id, while it waits: the
    webhooks dispatcher's horizon does not wait for it."""
    client = Client.objects.create(name="w", token_hash="w" * 64)
    Webhook.objects.create(client=client, url="http://127.0.0.1:9/h", events=["*"],
                           secret_salt=signing.new_salt())  # fmt: skip
    hooks, kafka_relay = Dispatcher([WebhookFanout()]), relay(timeout=6.0)
    hooks.tick()
    services.submit("echo", {}, client_id=client.pk)
    kafka_relay.tick()  # its horizon now covers the job: the next tick has one to send

    def kafka_tick() -> None:
        try:
            kafka_relay.tick()
        finally:
            connection.close()

    broker.freeze()
    waiting = threading.Thread(target=kafka_tick)
    try:
        waiting.start()
        time.sleep(0.5)  # the Kafka tick is now waiting for acknowledgements
        job, _ = services.submit("echo", {}, client_id=client.pk)
        started = time.monotonic()
        while not WebhookDelivery.objects.filter(source_job_id=job.pk).exists():
            hooks.tick()
            assert time.monotonic() - started < 4, "the webhooks waited for the Kafka tick"
            time.sleep(0.1)
        assert waiting.is_alive()
    finally:
        broker.thaw()
        waiting.join(10)


def test_lag_gauges_count_and_age_unacknowledged_events(broker, topic):
    d = relay()
    job, _ = services.submit("echo", {})
    raw("UPDATE jobs_jobevent SET at = now() - interval '5 minutes' WHERE job_id = %s", [job.pk])

    def gauges() -> dict[str, float]:
        return {f"{s.name}:{s.labels['subscriber']}": s.value
                for family in OutboxLagCollector().collect() for s in family.samples}  # fmt: skip

    now = gauges()
    assert 299 < now["jobs_outbox_lag_seconds:kafka"] < 400
    assert now["jobs_outbox_lag_events:kafka"] == 1
    drain(d)
    assert gauges() == {"jobs_outbox_lag_seconds:kafka": 0, "jobs_outbox_lag_events:kafka": 0}


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ('{"acks": "1"}', "acks"),
        ('{"enable.idempotence": false}', "enable.idempotence"),
        ("{not json", "not JSON"),
        ('["linger.ms", 5]', "JSON object"),
        ('{"linger.ms": {"x": 1}}', "JSON object"),
    ],
)
def test_settings_that_would_break_the_guarantees_are_refused(settings, config, error):
    settings.JOBS_KAFKA_BOOTSTRAP_SERVERS = "127.0.0.1:9"
    settings.JOBS_KAFKA_CONFIG = config
    with pytest.raises(ImproperlyConfigured, match=error):
        kafka.client_config()
    with pytest.raises(CommandError, match=error):
        call_command("runreaper")


def test_a_setting_librdkafka_does_not_know_stops_the_reaper_at_start(settings):
    settings.JOBS_KAFKA_BOOTSTRAP_SERVERS = "127.0.0.1:9"
    settings.JOBS_KAFKA_CONFIG = '{"no.such.setting": 1}'
    with pytest.raises(CommandError, match="JOBS_KAFKA_CONFIG: No such configuration property"):
        call_command("runreaper")


def test_passed_through_settings_reach_the_producer(settings):
    settings.JOBS_KAFKA_BOOTSTRAP_SERVERS = "127.0.0.1:9"
    settings.JOBS_KAFKA_CONFIG = '{"compression.type": "zstd", "message.timeout.ms": 60000}'
    config = kafka.client_config()
    assert config["compression.type"] == "zstd" and config["message.timeout.ms"] == 60000
    assert config["acks"] == "all" and config["enable.idempotence"] is True
    assert config["bootstrap.servers"] == "127.0.0.1:9"


def test_create_topic_and_status_commands(broker, settings, capsys):
    settings.JOBS_KAFKA_BOOTSTRAP_SERVERS = broker.bootstrap
    settings.JOBS_KAFKA_TOPIC = "jobs.events.created"
    settings.JOBS_KAFKA_CONFIG = ""
    call_command("kafka", "create-topic", "--partitions", "5", "--replication-factor", "1")
    call_command("kafka", "create-topic", "--partitions", "5", "--replication-factor", "1")
    call_command("kafka", "status")
    out = capsys.readouterr().out
    assert "topic jobs.events.created created: 5 partitions, replication factor 1" in out
    assert "topic jobs.events.created already exists" in out
    assert "topic jobs.events.created: 5 partitions" in out
    assert "relay: not started" in out and "domain events: not started" in out
    with pytest.raises(CommandError, match="at least 1"):
        call_command("kafka", "create-topic", "--partitions", "0")
    settings.JOBS_KAFKA_BOOTSTRAP_SERVERS = ""
    with pytest.raises(CommandError, match="JOBS_KAFKA_BOOTSTRAP_SERVERS is not set"):
        call_command("kafka", "status")


# --- domain events: publish() ------------------------------------------------------------


@subscriber("kafka.invoice.paid", name="tests.kafka_sink.invoice")
def _invoice_subscriber(event, ctx):
    return None


def domain_relay(timeout: float = 10.0) -> Dispatcher:
    """The Kafka relay as runreaper runs it: the history and the domain events."""
    started("kafka", "kafka.domain")
    d = Dispatcher([sink(timeout)], sources=SOURCES)
    d.tick()
    return d


def domain_cursor() -> int:
    return raw("SELECT last_id FROM jobs_outboxcursor WHERE name = 'kafka.domain'")[0][0]


def test_domain_events_are_produced_with_the_body_subscribers_get_and_the_publishers_key(
    broker, topic
):
    d = domain_relay()
    with transaction.atomic():
        keyed = [publish("kafka.invoice.paid", {"invoice": i, "é": [1.5]}, key="customer-7")
                 for i in range(3)]  # fmt: skip
        unkeyed = publish("kafka.invoice.paid", {"invoice": 9})
    (row,) = [r for r in lag() if r.subscriber == "kafka.domain"]
    assert row.events == 4
    assert drain(d) == 8  # and the queued events of the subscribers' four jobs
    got = [m for m in broker.read(topic, expect=8) if m.event_id.startswith("dev_")]
    ids = [f"dev_{i}" for i in [*keyed, unkeyed]]
    assert sorted(m.event_id for m in got) == sorted(ids)
    by_id = {m.event_id: m for m in got}
    assert {by_id[i].key for i in ids[:3]} == {"customer-7"}
    assert by_id[ids[3]].key == ids[3]  # no key: the event id
    assert len({by_id[i].partition for i in ids[:3]}) == 1  # one key, one partition...
    assert [by_id[i].offset for i in ids[:3]] == sorted(by_id[i].offset for i in ids[:3])
    for m in got:  # ...in publish order; each body is what its subscriber's job got
        assert m.type == "kafka.invoice.paid" and set(m.body) == {"id", "type", "payload",
                                                                   "created_at"}  # fmt: skip
        (job,) = Job.objects.filter(task="event:tests.kafka_sink.invoice",
                                    payload__id=m.event_id)  # fmt: skip
        assert m.body == job.payload
    assert domain_cursor() == unkeyed
    (row,) = [r for r in lag() if r.subscriber == "kafka.domain"]
    assert row.events == 0 and row.seconds == 0


def test_a_domain_event_committed_after_a_later_one_is_not_skipped(broker, topic):
    """Ids are drawn in the publisher's transaction: a later id may commit first. The
    cursor waits at the horizon until the earlier transaction has ended."""
    d = domain_relay()
    published, release = threading.Event(), threading.Event()
    early: list[int] = []

    def slow_publisher() -> None:
        try:
            with transaction.atomic():
                # No subscriber: the transaction writes no history (whose lock would
                # hold the horizon back for another reason).
                early.append(publish("kafka.nobody.listens", {"slow": True}))
                published.set()
                release.wait(10)
        finally:
            connection.close()

    t = threading.Thread(target=slow_publisher)
    t.start()
    try:
        assert published.wait(10)
        late = publish("kafka.nobody.listens", {"slow": False})  # commits first
        assert late > early[0]
        drain(d)
        assert domain_cursor() < early[0]  # not past an id whose transaction is open
        release.set()
        t.join(10)
    finally:
        release.set()
        t.join(10)
    assert drain(d) == 2
    got = broker.read(topic, expect=2)
    assert sorted(m.event_id for m in got) == sorted([f"dev_{early[0]}", f"dev_{late}"])
    assert domain_cursor() == late


def test_a_frozen_broker_holds_the_domain_cursor(broker, topic):
    d = domain_relay(timeout=1.0)
    event_id = publish("kafka.invoice.paid", {"frozen": True})
    broker.freeze()
    try:
        assert drain(d, rounds=2) == 0
        assert domain_cursor() < event_id
    finally:
        broker.thaw()
    drain(d)
    got = broker.read(topic, expect=2)
    assert [m.event_id for m in got if m.event_id.startswith("dev_")] == [f"dev_{event_id}"]


@pytest.mark.parametrize("key", ["", "k" * 256, 7])
def test_publish_refuses_a_key_kafka_could_not_carry_and_writes_nothing(key):
    with pytest.raises(ValueError, match="key must be"):
        publish("kafka.invoice.paid", {}, key=key)
    assert not DomainEvent.objects.exists()
    assert not Job.objects.filter(task__startswith="event:").exists()
