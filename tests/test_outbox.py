"""The outbox (issue 16): per-job seq, the dispatcher's cursor and horizon, publish().

Real PostgreSQL throughout; a second connection holds a transaction open to make the
id-order-is-not-commit-order gap real.
"""

from __future__ import annotations

import json

import psycopg
import pytest
from django.db import connection, transaction

from harness import database_url
from jobs import services
from jobs.events import publish, signing, subscriber
from jobs.events.lag import OutboxLagCollector
from jobs.events.outbox import Dispatcher
from jobs.events.reads import Built
from jobs.events.relay import WebhookFanout
from jobs.events.sources import DOMAIN, HISTORY
from jobs.models import Client, DomainEvent, Job, JobEvent, Webhook, WebhookDelivery
from jobs.worker import Worker
from tests.factories import raw

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def client():
    return Client.objects.create(name="outbox", token_hash="h" * 64)


@pytest.fixture
def hook(client):
    return Webhook.objects.create(
        client=client, url="http://127.0.0.1:9/hook", events=["*"], secret_salt=signing.new_salt()
    )


def fanout() -> Dispatcher:
    return Dispatcher([WebhookFanout()])


def start(dispatcher: Dispatcher) -> None:
    """A first tick places the cursor (at the beginning: the tests' database was
    flushed) and notes a horizon."""
    dispatcher.tick()


def drain(dispatcher: Dispatcher, rounds: int = 4) -> int:
    return sum(dispatcher.tick() for _ in range(rounds))


def test_each_transition_carries_the_jobs_next_seq():
    job, _ = services.submit("echo", {"n": 1})
    lease = services.claim("w1", job.pk)
    services.release([lease])
    lease = services.claim("w1", job.pk)
    services.complete([(lease, {"ok": True})])
    seqs = list(
        JobEvent.objects.filter(job_id=job.pk).order_by("id").values_list("seq", "to_status")
    )
    assert seqs == [(1, "queued"), (2, "processing"), (3, "queued"), (4, "processing"), (5, "done")]
    assert Job.objects.get(pk=job.pk).event_seq == 5


def test_a_rolled_back_change_is_never_dispatched(client, hook):
    d = fanout()
    start(d)
    with pytest.raises(RuntimeError), transaction.atomic():
        services.submit("echo", {}, client_id=client.pk)
        raise RuntimeError("roll back")
    kept, _ = services.submit("echo", {}, client_id=client.pk)
    drain(d)
    assert list(WebhookDelivery.objects.values_list("source_job_id", "type")) == [
        (kept.pk, "job.queued")
    ]


def test_an_id_taken_by_an_open_transaction_is_not_skipped(client, hook):
    """Ids are taken before commit: a later id may commit first. The cursor must not pass
    the earlier one while its transaction is open, and must deliver it once committed."""
    d = fanout()
    start(d)
    with psycopg.connect(database_url()) as other:
        other.execute(
            "INSERT INTO jobs_job (task, payload, queue, priority, run_at, max_retries, "
            "client_id, updated_by, status, retry_count, lease_version) VALUES "
            "('echo', '{}', 'default', 0, now(), 0, %s, 'api', 'queued', 0, 0) RETURNING id",
            [client.pk],
        )
        slow_job, slow_event = other.execute(
            "SELECT job_id, id FROM jobs_jobevent ORDER BY id DESC LIMIT 1"
        ).fetchone()
        fast, _ = services.submit("echo", {}, client_id=client.pk)  # committed first
        drain(d)
        assert list(WebhookDelivery.objects.values_list("source_job_id", flat=True)) == []
        (last_id,) = raw("SELECT last_id FROM jobs_outboxcursor WHERE name = 'webhooks'")[0]
        assert last_id < slow_event
        other.commit()
    drain(d)
    delivered = sorted(WebhookDelivery.objects.values_list("source_job_id", flat=True))
    assert delivered == sorted([slow_job, fast.pk])


def test_a_batch_that_fails_leaves_the_cursor_and_is_repeated(client, hook):
    """The cursor moves in the transaction of the work: a failed batch writes nothing."""
    d = fanout()
    start(d)
    services.submit("echo", {}, client_id=client.pk)
    # A constraint every new delivery row breaks: the batch fails inside its transaction.
    raw("ALTER TABLE jobs_webhookdelivery ADD CONSTRAINT t_block CHECK (seq < 0) NOT VALID")
    try:
        with pytest.raises(Exception, match="t_block"):
            drain(d)
        assert WebhookDelivery.objects.count() == 0
    finally:
        raw("ALTER TABLE jobs_webhookdelivery DROP CONSTRAINT t_block")
    drain(d)
    assert WebhookDelivery.objects.count() == 1


def test_deliveries_of_one_job_wait_for_the_one_before(client, hook):
    d = fanout()
    start(d)
    job, _ = services.submit("echo", {}, client_id=client.pk)
    lease = services.claim("w1", job.pk)
    services.complete([(lease, 1)])
    drain(d)
    rows = list(WebhookDelivery.objects.order_by("seq").values_list("seq", "job_id"))
    assert [s for s, _ in rows] == [1, 2, 3]
    assert rows[0][1] is not None and rows[1][1] is None and rows[2][1] is None
    # The first delivery job ends: its own terminal event releases the next one.
    first = services.claim("w2", rows[0][1])
    services.complete([(first, {"status": 200})])
    drain(d)
    rows = list(WebhookDelivery.objects.order_by("seq").values_list("seq", "job_id"))
    assert rows[1][1] is not None and rows[2][1] is None
    second = services.claim("w2", rows[1][1])
    services.fail([(second, "dead", True)])  # a dead letter does not stop the chain
    drain(d)
    assert WebhookDelivery.objects.get(seq=3).job_id is not None


def test_the_event_body_is_the_job_and_the_transition(client, hook):
    d = fanout()
    start(d)
    job, _ = services.submit("echo", {"x": 1}, client_id=client.pk)
    drain(d)
    delivery = WebhookDelivery.objects.get()
    body = json.loads(delivery.body)
    event = JobEvent.objects.get(job_id=job.pk)
    assert body["id"] == f"evt_{event.pk}" and body["type"] == "job.queued"
    assert body["data"]["id"] == job.pk and body["data"]["payload"] == {"x": 1}
    assert (body["data"]["from"], body["data"]["to"], body["data"]["seq"]) == (None, "queued", 1)
    assert body["data"]["task"] == "echo" and body["created_at"].endswith("Z")


TRICKY = [
    {"n": 1, "name": "x"},
    [1.5, 1e-05, 1e16, -0.0, 2**70],
    {"é": "ünï", "del": "\x7f"},
    "a string",
    None,
    12,
    {"deep": [[[{"a": None}]]]},
    {"s": "1.5,", "t": "v1e5]"},
]


def test_the_event_body_is_what_json_dumps_writes(client, hook):
    """The bodies are built fast (binary read, orjson) but stay json.dumps' bytes, the
    same as before: floats as Python spells them, non-ASCII escaped, big integers."""
    d = fanout()
    start(d)
    for i, result in enumerate(TRICKY):
        job, _ = services.submit("echo", {"p": TRICKY[-1 - i]}, client_id=client.pk)
        lease = services.claim("w1", job.pk)
        services.complete([(lease, result)])
    drain(d)
    bodies = list(WebhookDelivery.objects.order_by("event_id").values_list("body", flat=True))
    assert len(bodies) == 3 * len(TRICKY)
    for body in bodies:
        assert json.dumps(json.loads(body), separators=(",", ":")) == body
        assert json.loads(body)["created_at"].endswith("Z")
    results = [json.loads(b)["data"]["result"] for b in bodies if '"type":"job.done"' in b]
    assert results == TRICKY


def test_webhook_event_filter(client):
    Webhook.objects.create(client=client, url="http://127.0.0.1:9/", events=["job.done"],
                           secret_salt="s")  # fmt: skip
    other = Client.objects.create(name="other", token_hash="o" * 64)
    d = fanout()
    start(d)
    job, _ = services.submit("echo", {}, client_id=client.pk)
    services.submit("echo", {}, client_id=other.pk)
    services.complete([(services.claim("w", job.pk), 1)])
    drain(d)
    assert list(WebhookDelivery.objects.values_list("type", "source_job_id")) == [
        ("job.done", job.pk)
    ]


# --- publish() and @subscriber ------------------------------------------------------------

RAN: list[tuple[str, str]] = []


@subscriber("invoice.paid", name="tests.outbox.accounting")
def accounting(event, ctx):
    RAN.append(("accounting", event["id"]))
    return {"seen": event["payload"]}


@subscriber("invoice.paid", name="tests.outbox.mailer")
def mailer(event, ctx):
    RAN.append(("mailer", event["id"]))


def test_publish_in_a_rolled_back_transaction_leaves_nothing():
    with pytest.raises(RuntimeError), transaction.atomic():
        publish("invoice.paid", {"invoice": 1})
        raise RuntimeError("roll back")
    assert DomainEvent.objects.count() == 0
    assert not Job.objects.filter(task__startswith="event:").exists()


def test_publish_in_a_committed_transaction_runs_each_subscriber_once():
    RAN.clear()
    with transaction.atomic():
        event_id = publish("invoice.paid", {"invoice": 7})
    jobs = Job.objects.filter(task__startswith="event:").order_by("task")
    assert [j.task for j in jobs] == ["event:tests.outbox.accounting", "event:tests.outbox.mailer"]
    Worker(["default"], 2, burst=True, worker_id="w-events").run()
    assert sorted(RAN) == [("accounting", f"dev_{event_id}"), ("mailer", f"dev_{event_id}")]
    done = {j.task: (j.status, j.result) for j in Job.objects.filter(task__startswith="event:")}
    assert done["event:tests.outbox.accounting"] == ("done", {"seen": {"invoice": 7}})
    assert done["event:tests.outbox.mailer"][0] == "done"
    assert DomainEvent.objects.get().type == "invoice.paid"


def test_lag_gauge_shows_the_oldest_unhandled_event(client, hook):
    raw("DELETE FROM jobs_outboxcursor")  # the migrations' seeds, had no test flushed them
    d = fanout()
    start(d)
    job, _ = services.submit("echo", {}, client_id=client.pk)
    raw("UPDATE jobs_jobevent SET at = now() - interval '5 minutes' WHERE job_id = %s", [job.pk])

    def lag() -> dict[str, float]:
        seconds, events = OutboxLagCollector().collect()
        return {s.labels["subscriber"]: (s.value, n.value)
                for s, n in zip(seconds.samples, events.samples, strict=True)}  # fmt: skip

    age, behind = lag()["webhooks"]
    assert 299 < age < 400 and behind == 1
    drain(d)
    assert lag() == {"webhooks": (0.0, 0.0)}


def test_pruning_a_delivery_job_takes_its_delivery_row(client, hook):
    job, _ = services.submit(signing.DELIVER_TASK, {"delivery_id": 0}, queue="webhooks")
    services.complete([(services.claim("w", job.pk), {"status": 200})])
    WebhookDelivery.objects.create(webhook=hook, event_id=1, source_job_id=1, seq=1,
                                   type="job.done", body="{}", job_id=job.pk)  # fmt: skip
    raw("UPDATE jobs_job SET finished_at = now() - interval '2 days' WHERE id = %s", [job.pk])
    assert services.prune_finished(86400, ["done"], 100) == 1
    assert not WebhookDelivery.objects.exists()


def test_an_open_transaction_that_writes_no_history_does_not_hold_the_outbox(client, hook):
    d = fanout()
    start(d)
    with psycopg.connect(database_url()) as other:
        other.execute("INSERT INTO jobs_client (name, token_hash, is_active, created_at) "
                      "VALUES ('busy', 'b', true, now())")  # fmt: skip
        job, _ = services.submit("echo", {}, client_id=client.pk)
        drain(d)
        assert list(WebhookDelivery.objects.values_list("source_job_id", flat=True)) == [job.pk]
        other.rollback()


class Recorder:
    """A subscriber that keeps the ids it was handed, from the beginning of a source."""

    name = "recorder"
    starts_at_beginning = True

    def __init__(self) -> None:
        self.ids: list[int] = []

    def handle(self, events) -> int:
        self.ids += [e.id for e in events]
        return len(events)


@pytest.mark.parametrize("table", ["jobs_jobevent", "jobs_domainevent"])
def test_the_newest_open_transaction_holds_the_horizon(table):
    """The open writer has the newest transaction id and nothing has committed since it
    began: a snapshot's xmax is then its own id, so it is not in the snapshot's list of
    transactions in progress (issue 30: the first events of a burst were skipped while
    the one transaction writing them was still open). Its rows must wait, not be passed."""
    recorder = Recorder()
    source = {"jobs_jobevent": HISTORY, "jobs_domainevent": DOMAIN}[table]
    d = Dispatcher([recorder], sources=[source])
    start(d)
    with psycopg.connect(database_url()) as other:
        if source is HISTORY:
            other.execute(
                "INSERT INTO jobs_job (task, payload, queue, priority, run_at, max_retries, "
                "updated_by, status, retry_count, lease_version) VALUES "
                "('echo', '{}', 'default', 0, now(), 0, 'api', 'queued', 0, 0)"
            )
        else:  # publish()'s insert may be the first write of its transaction
            other.execute("INSERT INTO jobs_domainevent (type, payload, at) "
                          "VALUES ('order.placed', '{}', now())")  # fmt: skip
        (open_id,) = other.execute(f"SELECT max(id) FROM {table}").fetchone()
        drain(d)  # notes a horizon past open_id while its transaction is open, then ticks
        name = "recorder" + source.suffix
        (last_id,) = raw("SELECT last_id FROM jobs_outboxcursor WHERE name = %s", [name])[0]
        assert last_id < open_id
        other.commit()
    drain(d)
    assert recorder.ids == [open_id]


def test_dispatchers_sharing_built_events_each_get_every_event_once_in_order(client):
    """The reaper's dispatchers read and build a range once (dispatchers()): one that
    follows takes it from the window, across batch edges; one
    that fell behind the window reads the database. Every subscriber gets each event
    once, in id order, whatever the order the three tick in."""
    built = Built(keep=12)
    recorders = [Recorder() for _ in range(3)]
    for i, r in enumerate(recorders):
        r.name = f"recorder{i}"
    first, second, behind = (Dispatcher([r], batch=5, built=built) for r in recorders)
    for d in (first, second, behind):
        start(d)
    for i in range(8):  # 8 queued events
        services.submit("echo", {"n": i}, client_id=client.pk)
    expected = list(
        JobEvent.objects.filter(kind="transition").order_by("id").values_list("id", flat=True)
    )
    read_from_db = built.hits
    for _ in range(4):
        first.tick()
        second.tick()
    assert built.hits - read_from_db >= len(expected)  # the second never read a row itself
    for i in range(8, 30):
        services.submit("echo", {"n": i}, client_id=client.pk)
    expected = list(
        JobEvent.objects.filter(kind="transition").order_by("id").values_list("id", flat=True)
    )
    for _ in range(12):
        first.tick()
        second.tick()
        behind.tick()
    for r in recorders:
        assert r.ids == expected


def test_a_read_joins_the_jobs_of_its_batch_only(client):
    """A relay far behind (its horizon thousands of events ahead) joins the jobs and
    deliveries of the batch it reads, not of every event up to the horizon (D396): the
    cost of a read stays that of its batch however long the backlog."""
    for i in range(30):
        services.submit("echo", {"n": i}, client_id=client.pk)
    with connection.cursor() as cur:
        cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + HISTORY.events_sql, [0, 1 << 62, 5])
        plan = cur.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    joins, stack = [], [plan[0]["Plan"]]
    while stack:
        node = stack.pop()
        stack += node.get("Plans", [])
        if node["Node Type"] in ("Nested Loop", "Hash Join", "Merge Join"):
            joins.append(node["Actual Rows"] * node["Actual Loops"])
    assert joins and max(joins) <= 5
