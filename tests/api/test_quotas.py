"""Per-client quotas (issue 28 item 6): schedules and webhooks per client, signals per
job; `quota_exceeded` naming the limit, nothing written by a refusal, a client's own
limit set by staff in the admin, and the limit held when requests race."""

from __future__ import annotations

import threading

import pytest
from django.contrib.auth.models import Permission, User
from django.db import close_old_connections, connection
from django.urls import reverse

from jobs import admission, services, signals
from jobs.exceptions import QuotaExceeded
from jobs.models import Client, JobSignal, Schedule, Webhook
from jobs.schedules import define

pytestmark = pytest.mark.django_db

SCHEDULES = "/api/v1/schedules/"
WEBHOOKS = "/api/v1/webhooks/"


def schedule(api, n: int):
    body = {"name": f"s{n}", "interval_seconds": 60, "task": "echo"}
    return api.post(SCHEDULES, body, format="json")


def webhook(api):
    return api.post(WEBHOOKS, {"url": "http://127.0.0.1:9/h", "events": ["*"]}, format="json")


def assert_quota(r, limit: int, what: str):
    assert r.status_code == 400, r.content
    assert r["Content-Type"].startswith("application/json")
    assert r.json()["code"] == "quota_exceeded"
    assert f"at most {limit} {what}" in r.json()["detail"], r.json()


def test_the_documented_defaults():
    assert [admission.quota_default(q) for q in (admission.SCHEDULES, admission.WEBHOOKS,
                                        admission.SIGNALS_PER_JOB)] == [100, 10, 20]  # fmt: skip


def test_schedules_per_client(api, me, other, settings):
    settings.JOBS_MAX_SCHEDULES = 2
    assert [schedule(api, n).status_code for n in (1, 2)] == [201, 201]
    assert_quota(schedule(api, 3), 2, "schedules")
    assert Schedule.objects.filter(client=me).count() == 2
    assert schedule(other[1], 1).status_code == 201  # another client's quota is its own
    me.max_schedules = 3
    me.save()
    assert schedule(api, 3).status_code == 201
    assert_quota(schedule(api, 4), 3, "schedules")


def test_webhooks_per_client(api, me, settings):
    settings.JOBS_WEBHOOK_ALLOW_PRIVATE = True
    settings.JOBS_MAX_WEBHOOKS = 1
    assert webhook(api).status_code == 201
    assert_quota(webhook(api), 1, "webhooks")
    assert Webhook.objects.filter(client=me).count() == 1


def test_signals_per_job(api, me, settings):
    settings.JOBS_MAX_SIGNALS_PER_JOB = 2
    job, _ = services.submit("echo", {}, client_id=me.pk)
    url = f"/api/v1/jobs/{job.pk}/signal/"
    assert [api.post(url, {"key": k}, format="json").status_code for k in "ab"] == [202, 202]
    assert_quota(api.post(url, {"key": "c", "payload": {"x": 1}}, format="json"), 2,
                 "signals per job")  # fmt: skip
    with pytest.raises(QuotaExceeded):  # from Django code too
        signals.signal_job(job.pk, "d")
    assert sorted(JobSignal.objects.filter(job_id=job.pk).values_list("key", flat=True)) == [
        "a",
        "b",
    ]
    other_job, _ = services.submit("echo", {}, client_id=me.pk)
    assert signals.signal_job(other_job.pk, "a") is False  # per job, not per client


def test_staff_raise_one_clients_limit_in_the_admin(api, me, client, settings):
    settings.JOBS_MAX_WEBHOOKS = 0
    settings.JOBS_WEBHOOK_ALLOW_PRIVATE = True
    assert_quota(webhook(api), 0, "webhooks")
    staff = User.objects.create_user("staff", password="pw", is_staff=True)
    staff.user_permissions.set(
        Permission.objects.filter(codename__in=["view_client", "change_client"])
    )
    client.force_login(staff)
    url = reverse("admin:jobs_client_change", args=[me.pk])
    assert "max_webhooks" in client.get(url).content.decode()
    r = client.post(url, {"name": me.name, "is_active": "on", "max_webhooks": "1",
                          "max_schedules": "", "max_signals_per_job": ""})  # fmt: skip
    assert r.status_code == 302, r.content.decode()[:2000]
    me.refresh_from_db()
    assert (me.max_webhooks, me.max_schedules) == (1, None)
    assert webhook(api).status_code == 201
    assert_quota(webhook(api), 1, "webhooks")


@pytest.mark.django_db(transaction=True)
def test_racing_creations_never_pass_the_limit(settings):
    """Eight threads, each its own session, race for the last two places."""
    settings.JOBS_MAX_SCHEDULES = 3
    me = Client.objects.create(name="racer", token_hash="r" * 64)
    define.create({"name": "first", "interval_seconds": 60, "task": "echo"}, client=me,
                  origin=Schedule.Origin.API)  # fmt: skip
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def create(n: int) -> None:
        try:
            barrier.wait()
            define.create({"name": f"r{n}", "interval_seconds": 60, "task": "echo"}, client=me,
                          origin=Schedule.Origin.API)  # fmt: skip
            outcomes.append("created")
        except QuotaExceeded:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=create, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    close_old_connections()
    assert sorted(outcomes) == ["created"] * 2 + ["refused"] * 6
    assert Schedule.objects.filter(client=me).count() == 3
