"""Where an outbox subscriber starts (issue 39): the built-in subscribers from the
beginning of the history, a webhook after the event its creation noted, the Kafka sink
where an operator says (`manage.py outbox`), a migration that never rewinds a cursor.

Real PostgreSQL; the dispatcher ticks in-process. The same with real processes (API,
workers, a reaper started late and killed -9, a real receiver) is
tests/test_outbox_start_e2e.py.
"""

from __future__ import annotations

import importlib
import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from rest_framework.test import APIClient

from jobs import selectors, services
from jobs.events import signing
from jobs.events.lag import OutboxLagCollector
from jobs.events.outbox import Dispatcher
from jobs.events.relay import WebhookFanout
from jobs.events.sources import HISTORY
from jobs.events.streams import StreamPublisher
from jobs.models import Client, DomainEvent, JobEvent, Webhook, WebhookDelivery
from tests.factories import raw

pytestmark = pytest.mark.django_db(transaction=True)


class Recorder:
    """A subscriber that keeps the ids it was handed; `starts_at_beginning` as given."""

    def __init__(self, name: str, starts_at_beginning: bool) -> None:
        self.name, self.starts_at_beginning = name, starts_at_beginning
        self.ids: list[int] = []

    def handle(self, events) -> int:
        self.ids += [e.id for e in events]
        return len(events)


def cursors() -> dict[str, int]:
    return dict(raw("SELECT name, last_id FROM jobs_outboxcursor"))


def drain(d: Dispatcher, rounds: int = 4) -> int:
    return sum(d.tick() for _ in range(rounds))


def transitions(job_ids) -> list[int]:
    rows = JobEvent.objects.filter(job_id__in=job_ids, kind=JobEvent.TRANSITION)
    return sorted(rows.values_list("id", flat=True))


@pytest.fixture
def client():
    return Client.objects.create(name="start", token_hash="s" * 64)


@pytest.fixture
def no_cursors():
    """No cursor at all: a database whose dispatcher never ran (before migration 0024, a
    new one too), or whose rows were deleted."""
    raw("DELETE FROM jobs_outboxcursor")


def test_events_written_before_the_first_tick_reach_the_built_in_subscribers(no_cursors, client):
    """The issue: jobs finished before the dispatcher's first tick had their events
    skipped (the cursor was created at the present). A built-in subscriber starts from
    the beginning: every one of them is handed out, once."""
    Webhook.objects.create(client=client, url="http://127.0.0.1:9/h", events=["*"],
                           secret_salt=signing.new_salt())  # fmt: skip
    job_ids = [s.job_id for s in services.submit_many(
        [services.NewJob("echo", {"n": i}) for i in range(5)], client_id=client.pk)]  # fmt: skip
    stream = Recorder(StreamPublisher.name, starts_at_beginning=True)
    d = Dispatcher([WebhookFanout(), stream])
    drain(d)
    expected = transitions(job_ids)
    delivered = WebhookDelivery.objects.filter(source_job_id__in=job_ids)
    assert sorted(delivered.values_list("event_id", flat=True)) == expected
    assert [i for i in stream.ids if i in set(expected)] == expected
    drain(d)  # nothing twice
    assert delivered.count() == len(expected) and len(stream.ids) == len(set(stream.ids))


def test_a_webhook_gets_the_events_written_after_its_creation_only(client):
    """Created through the API, a webhook notes the last history id drawn: the events
    of its client's jobs before it are not its own, every later one is, whenever the
    dispatcher gets to them (here: after both)."""
    Client.objects.filter(pk=client.pk).delete()
    me, token = Client.create_with_token("hooked")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    before, _ = services.submit("echo", {}, client_id=me.pk)
    with override_allow_private():
        r = api.post("/api/v1/webhooks/", {"url": "http://127.0.0.1:9/h", "events": ["*"]},
                     format="json")  # fmt: skip
    assert r.status_code == 201, r.content
    hook = Webhook.objects.get(pk=r.json()["id"])
    assert hook.after_event_id == max(transitions([before.pk]))
    after, _ = services.submit("echo", {}, client_id=me.pk)
    drain(Dispatcher([WebhookFanout()]))
    got = WebhookDelivery.objects.filter(webhook=hook)
    assert sorted(got.values_list("event_id", flat=True)) == transitions([after.pk])


def override_allow_private():
    from django.test import override_settings

    return override_settings(JOBS_WEBHOOK_ALLOW_PRIVATE=True)


def test_a_sink_without_a_cursor_relays_nothing_until_started(client):
    """An operator's sink (starts_at_beginning false, like Kafka) writes no cursor of
    its own: it waits, says so (gauge), and starts where `outbox start` puts it."""
    first, _ = services.submit("echo", {}, client_id=client.pk)
    sink = Recorder("kafka", starts_at_beginning=False)
    d = Dispatcher([sink])
    drain(d)
    assert sink.ids == [] and "kafka" not in cursors()
    gauge = not_started(OutboxLagCollector(d.cursor_names))
    assert gauge == {"kafka": 1.0}
    out = io.StringIO()
    call_command("outbox", "start", "kafka", "--from", "now", stdout=out)
    assert "kafka: starts after event" in out.getvalue()
    assert cursors()["kafka"] == max(transitions([first.pk]))
    second, _ = services.submit("echo", {}, client_id=client.pk)
    drain(d)
    assert sink.ids == transitions([second.pk])  # from now: the first job's are skipped
    assert not_started(OutboxLagCollector(d.cursor_names)) == {"kafka": 0.0}


def not_started(collector: OutboxLagCollector) -> dict[str, float]:
    (family,) = [f for f in collector.collect() if f.name == "jobs_outbox_not_started"]
    return {s.labels["subscriber"]: s.value for s in family.samples}


def test_outbox_start_from_the_beginning_or_an_id_and_move(client):
    jobs = [services.submit("echo", {"n": i}, client_id=client.pk)[0].pk for i in range(3)]
    ids = transitions(jobs)
    call_command("outbox", "start", "kafka", "--from", "beginning", stdout=io.StringIO())
    sink = Recorder("kafka", starts_at_beginning=False)
    drain(Dispatcher([sink]))
    assert [i for i in sink.ids if i in set(ids)] == ids
    with pytest.raises(CommandError, match="already started.*--move"):
        call_command("outbox", "start", "kafka", "--from", "now")
    call_command("outbox", "start", "kafka", "--from", str(ids[0]), "--move",
                 stdout=io.StringIO())  # fmt: skip
    again = Recorder("kafka", starts_at_beginning=False)
    drain(Dispatcher([again]))
    assert again.ids == ids[1:]  # back: sent again after the id given


def test_outbox_start_refuses_what_it_cannot_mean(client):
    services.submit("echo", {}, client_id=client.pk)
    drawn = selectors.last_drawn_id()
    before = cursors()
    for argv, message in (
        (["start", "kafka", "--from", str(drawn + 1000)], "ids up to"),
        (["start", "kafka", "kafka.domain", "--from", "1"], "one table"),
    ):
        with pytest.raises(CommandError, match=message):
            call_command("outbox", *argv)
    for argv in (["start", "nosuch", "--from", "now"], ["start", "kafka", "--from", "-3"],
                 ["start", "kafka", "--from", "soon"], ["start", "kafka"]):  # fmt: skip
        with pytest.raises(CommandError):
            call_command("outbox", *argv)
    assert cursors() == before


def test_outbox_start_kafka_and_its_domain_events_at_now(client):
    DomainEvent.objects.create(type="order.placed", payload={})
    services.submit("echo", {}, client_id=client.pk)
    call_command("outbox", "start", "kafka", "kafka.domain", "--from", "now",
                 stdout=io.StringIO())  # fmt: skip
    got = cursors()
    assert got["kafka"] == max(JobEvent.objects.values_list("id", flat=True))
    assert got["kafka.domain"] == max(DomainEvent.objects.values_list("id", flat=True))


def test_outbox_list_shows_positions_and_the_sinks_not_started(client):
    services.submit("echo", {}, client_id=client.pk)
    drain(Dispatcher([WebhookFanout()]))
    out = io.StringIO()
    call_command("outbox", "list", stdout=out)
    lines = out.getvalue().splitlines()
    assert any(line.startswith("webhooks: after event ") for line in lines), lines
    assert "kafka: not started (manage.py outbox start kafka --from beginning|now|ID)" in lines
    assert any(line.startswith("kafka.domain: not started") for line in lines)


def test_the_migration_adds_missing_built_in_cursors_and_rewinds_none():
    """A new database: both from the beginning. A running deployment: its cursors stay
    where they are; a built-in one it lacks (`stream`, Redis having been off) starts
    where the oldest history cursor stands."""
    raw("DELETE FROM jobs_outboxcursor")
    seed()
    assert cursors() == {"webhooks": 0, "stream": 0}
    raw("DELETE FROM jobs_outboxcursor")
    raw("INSERT INTO jobs_outboxcursor (name, last_id, updated_at) VALUES "
        "('webhooks', 900, now()), ('kafka', 700, now()), ('kafka.domain', 5, now())")  # fmt: skip
    seed()
    assert cursors() == {"webhooks": 900, "kafka": 700, "kafka.domain": 5, "stream": 700}
    seed()  # again: nothing moves
    assert cursors() == {"webhooks": 900, "kafka": 700, "kafka.domain": 5, "stream": 700}


def seed() -> None:
    migration = importlib.import_module("jobs.migrations.0024_outbox_from_start")
    with connection.cursor() as cur:
        cur.execute(migration.SEED_BUILT_IN_CURSORS_SQL)


def test_the_collector_reports_the_reapers_own_subscribers_only(client):
    """A stream cursor nobody moves (Redis off in this deployment) is not lag."""
    raw("INSERT INTO jobs_outboxcursor (name, last_id, updated_at) VALUES ('stream', 0, now()) "
        "ON CONFLICT (name) DO UPDATE SET last_id = 0")  # fmt: skip
    services.submit("echo", {}, client_id=client.pk)
    d = Dispatcher([WebhookFanout()], sources=(HISTORY,))
    drain(d)
    families = {f.name: f for f in OutboxLagCollector(d.cursor_names).collect()}
    assert {s.labels["subscriber"] for s in families["jobs_outbox_lag_seconds"].samples} == {
        "webhooks"
    }
    everyone = {f.name: f for f in OutboxLagCollector().collect()}
    assert "stream" in {s.labels["subscriber"] for s in everyone["jobs_outbox_lag_events"].samples}
