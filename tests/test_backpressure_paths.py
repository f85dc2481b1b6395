"""Backpressure on the paths that make jobs without a request (issue 28, D109, D110):
past JOBS_MAX_QUEUE_DEPTH the scheduler skips a slot and counts it; the webhook
fan-out keeps deliveries waiting, counts them, and releases them once the queue has
room. Nothing is lost without a counter."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone
from prometheus_client import REGISTRY

from jobs import admission, services
from jobs.events import signing
from jobs.events.outbox import Dispatcher
from jobs.events.relay import WebhookFanout
from jobs.models import Client, Job, SchedulerRun, Webhook, WebhookDelivery
from jobs.schedules import firing
from jobs.schedules.scheduler import Scheduler
from tests.factories import JobFactory
from tests.test_schedules import backdate, jobs_of, make

pytestmark = pytest.mark.django_db(transaction=True)


def sample(name: str, labels: dict | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_a_slot_whose_queue_is_full_is_skipped_and_counted(settings):
    settings.JOBS_MAX_QUEUE_DEPTH = 2
    backlog = JobFactory.create_batch(3, queue="default")
    s = make()
    backdate(s, 0)
    skipped = sample("jobs_schedule_slots_total", {"outcome": "queue_full"})
    report = Scheduler().tick()
    assert (report.jobs, report.skipped) == (0, 1)
    assert not jobs_of(s)
    assert SchedulerRun.objects.get(schedule=s).job_id is None  # the slot is claimed, once
    assert sample("jobs_schedule_slots_total", {"outcome": "queue_full"}) == skipped + 1
    # Staff "run now" is an explicit act: it makes its job whatever the depth.
    with transaction.atomic():
        assert firing.run_now(s.pk, "staff:ann").job_id is not None
    # Once the queue drains below the bound, the next slot fires as usual.
    services.cancel([j.pk for j in backlog] + [j.pk for j in jobs_of(s)], actor="staff:ann")
    backdate(s, 0)
    assert Scheduler().tick().jobs == 1


def test_parked_jobs_skip_no_slot_and_hold_no_delivery(settings):
    """Past the limit only jobs due within JOBS_QUEUE_DEPTH_HORIZON count (D198): jobs
    parked far ahead neither skip a schedule's slot nor hold back the webhook fan-out."""
    settings.JOBS_MAX_QUEUE_DEPTH = 2
    far = timezone.now() + timedelta(days=365)
    JobFactory.create_batch(3, queue="default", run_at=far)
    JobFactory.create_batch(3, queue="webhooks", run_at=far)
    s = make()
    backdate(s, 0)
    assert (Scheduler().tick().jobs, len(jobs_of(s))) == (1, 1)
    assert admission.queue_depth("webhooks", 2) == 0  # the fan-out's room: the whole limit
    JobFactory.create_batch(2, queue="default")  # due work counts: 3 due now
    backdate(s, 0)
    assert Scheduler().tick().skipped == 1


def test_a_full_queue_holds_webhook_deliveries_and_releases_them_with_room(settings):
    client = Client.objects.create(name="hooks", token_hash="h" * 64)
    for n in range(3):
        Webhook.objects.create(client=client, url=f"http://127.0.0.1:9/{n}", events=["*"],
                               secret_salt=signing.new_salt())  # fmt: skip
    dispatcher = Dispatcher([WebhookFanout()])
    dispatcher.tick()  # its first tick notes a horizon
    settings.JOBS_MAX_QUEUE_DEPTH = 2
    admission.clear_depth_cache()
    held = sample("jobs_webhook_deliveries_held_total")

    services.submit("echo", {}, client_id=client.pk)  # one event, three webhooks
    for _ in range(3):
        dispatcher.tick()
    deliveries = WebhookDelivery.objects.order_by("id")
    assert deliveries.count() == 3  # every delivery is recorded
    assert deliveries.filter(job__isnull=False).count() == 2  # as many jobs as there is room
    assert sample("jobs_webhook_deliveries_held_total") == held + 1
    assert Job.objects.filter(queue=signing.WEBHOOK_QUEUE, status="queued").count() == 2

    # One delivery job is claimed: the queue has room, and the held one gets its job on
    # the next tick without any new event for its chain.
    first = Job.objects.filter(queue=signing.WEBHOOK_QUEUE).order_by("id").first()
    assert services.claim("w-hooks", first.pk) is not None
    admission.clear_depth_cache()
    dispatcher.tick()
    assert deliveries.filter(job__isnull=True).count() == 0
    assert sample("jobs_webhook_deliveries_held_total") == held + 1
