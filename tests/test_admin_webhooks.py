"""Webhooks in the staff console (issue 16): deliveries with their status, the redeliver
action (permission, audit, message) and the per-endpoint failure rate on the dashboard."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.messages import get_messages
from django.core.cache import cache
from django.urls import reverse

from jobs import services
from jobs.events import signing
from jobs.models import Client, Job, JobEvent, Webhook, WebhookDelivery
from tests.test_admin import make_staff

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _empty_cache():
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def deliveries():
    """One dead letter (3 attempts) and one delivered, on one webhook."""
    owner = Client.objects.create(name="owner", token_hash="o" * 64)
    hook = Webhook.objects.create(client=owner, url="https://example.com/h", events=["*"],
                                  secret_salt="s")  # fmt: skip
    dead, _ = services.submit(signing.DELIVER_TASK, {"delivery_id": 0}, queue="webhooks",
                              max_retries=0)  # fmt: skip
    ok, _ = services.submit(signing.DELIVER_TASK, {"delivery_id": 0}, queue="webhooks")
    services.fail([(services.claim("w", dead.pk), "webhook 1 answered HTTP 503", False)])
    services.complete([(services.claim("w", ok.pk), {"status": 200})])
    common = {"webhook": hook, "source_job_id": 1, "type": "job.done", "body": "{}"}
    d_dead = WebhookDelivery.objects.create(event_id=1, seq=1, job_id=dead.pk, attempts=3,
                                            last_status_code=503, **common)  # fmt: skip
    d_ok = WebhookDelivery.objects.create(event_id=2, seq=2, job_id=ok.pk, attempts=1,
                                          last_status_code=200, **common)  # fmt: skip
    return hook, d_dead, d_ok


def redeliver(client, ids):
    url = reverse("admin:jobs_webhookdelivery_changelist")
    return client.post(url, {"action": "redeliver", "_selected_action": ids}, follow=True)


def test_dead_letters_are_listed_and_redelivered_with_an_audit(client, deliveries):
    hook, d_dead, d_ok = deliveries
    user = make_staff("ops", "view_webhookdelivery", "redeliver_webhookdelivery", "view_job")
    client.force_login(user)
    page = client.get(reverse("admin:jobs_webhookdelivery_changelist") + "?status=failed")
    assert page.status_code == 200
    assert [d.pk for d in page.context["cl"].result_list] == [d_dead.pk]
    assert "failed (dead letter)" in page.content.decode()
    response = redeliver(client, [d_dead.pk, d_ok.pk])
    assert [str(m) for m in get_messages(response.wsgi_request)] == [
        "1 redelivered, 1 skipped: not a dead letter"
    ]
    job = Job.objects.get(pk=d_dead.job_id)
    assert (job.status, job.retry_count) == ("queued", 0)
    assert JobEvent.objects.filter(job_id=job.pk).last().actor == "staff:ops"
    entry = LogEntry.objects.get()
    assert entry.object_id == str(d_dead.pk) and "redelivered by staff:ops" in entry.change_message


def test_redeliver_needs_its_permission(client, deliveries):
    _, d_dead, _ = deliveries
    client.force_login(make_staff("viewer", "view_webhookdelivery"))
    response = redeliver(client, [d_dead.pk])
    assert Job.objects.get(pk=d_dead.job_id).status == "failed"
    assert not LogEntry.objects.exists()
    assert response.status_code == 200


def test_the_dashboard_shows_each_endpoints_failure_rate(client, deliveries):
    hook, _, _ = deliveries
    client.force_login(make_staff("dash", "view_job"))
    html = client.get(reverse("admin:jobs_job_dashboard")).content.decode()
    assert 'id="webhook-table"' in html and hook.url in html
    # 4 attempts, 1 delivered: 75% of the attempts failed; 1 dead letter.
    row = html[html.index(hook.url) :].split("</tr>")[0]
    assert "<td>2</td><td>4</td><td>1</td>" in row and "75%" in row
