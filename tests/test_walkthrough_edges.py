"""Rough edges a new user met in a walk-through, each held here: a paused queue's jobs
say why they wait (API, admin, `queue list`), the admin's words for a spent budget and a
durable park, internal tasks kept off the admin's job list, a paused schedule with no
stale next run, and `@periodic` taking the API's `interval_seconds`."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth.models import User
from django.core.management import call_command
from django.urls import reverse

from jobs import queuecontrol, services
from jobs.admin.display import budget_text
from jobs.admin.options import JobEventInline
from jobs.events import signing
from jobs.models import Job, JobEvent, Schedule
from jobs.schedules import define, periodic
from tests.api.conftest import authed, new_client


@pytest.fixture
def staff(client):
    client.force_login(User.objects.create_superuser("root", password="pw"))
    return client


@pytest.mark.django_db(transaction=True)
def test_a_job_on_a_paused_queue_says_so_in_the_api_the_admin_and_queue_list(
    settings, staff, capsys
):
    settings.JOBS_QUEUES = {"default": {}, "mail": {}}
    me, token = new_client()
    api = authed(token)
    job_id = api.post("/api/v1/jobs/", {"task": "echo", "payload": 1, "queue": "mail"},
                      format="json").json()["id"]  # fmt: skip
    assert api.get(f"/api/v1/jobs/{job_id}/").json()["wait_reason"] is None
    queuecontrol.set_paused("mail", True)
    assert api.get(f"/api/v1/jobs/{job_id}/").json()["wait_reason"] == "queue_paused"
    assert api.get("/api/v1/jobs/?queue=mail").json()["results"][0]["wait_reason"] == (
        "queue_paused"
    )
    page = staff.get(reverse("admin:jobs_job_change", args=[job_id])).content.decode()
    assert "queue_paused" in page
    call_command("queue", "list")
    assert "mail\tpaused (jobs wait: queue_paused)" in capsys.readouterr().out
    queuecontrol.set_paused("mail", False)
    assert api.get(f"/api/v1/jobs/{job_id}/").json()["wait_reason"] is None


@pytest.mark.parametrize(
    ("retry_count", "max_retries", "words"),
    [(1, 0, "1 attempt (0 retries)"), (2, 1, "2 attempts (1 retry)"),
     (4, 3, "4 attempts (3 retries)"), (1, 3, "1 of 3 retries")],
)  # fmt: skip
def test_the_spent_budget_reads_as_english(retry_count, max_retries, words):
    assert budget_text(retry_count, max_retries) == words


def test_a_durable_park_is_labelled_in_the_history():
    inline = JobEventInline(Job, admin.site)
    park = JobEvent(from_status="processing", to_status="queued", lease_version=2)
    retry = JobEvent(from_status="processing", to_status="queued", lease_version=2,
                     error="ValueError: boom")  # fmt: skip
    assert "parked by its handler" in inline.transition(park)
    assert inline.transition(retry) == "processing → queued"


@pytest.mark.django_db
def test_internal_tasks_stay_off_the_job_list_unless_asked_for(staff):
    mine, _ = services.submit("echo", {})
    delivery, _ = services.submit(signing.DELIVER_TASK, {"delivery_id": 0}, queue="webhooks")
    url = reverse("admin:jobs_job_changelist")

    def listed(query: str = "") -> set[int]:
        return {j.pk for j in staff.get(url + query).context["cl"].result_list}

    assert listed() == {mine.pk}
    assert listed("?internal=all") == {mine.pk, delivery.pk}
    assert listed("?internal=only") == {delivery.pk}
    assert listed(f"?task={signing.DELIVER_TASK}") == {delivery.pk}


@pytest.mark.django_db
def test_a_paused_schedule_shows_no_next_run_until_resumed():
    s = define.create({"name": "s", "interval_seconds": 60, "task": "echo", "payload": {}},
                      client=None, origin=Schedule.Origin.ADMIN)  # fmt: skip
    assert s.next_fire_at is not None
    define.update(s, {"enabled": False})
    s.refresh_from_db()
    assert s.next_fire_at is None
    define.update(s, {"enabled": True})
    s.refresh_from_db()
    assert s.next_fire_at is not None
    paused = define.create({"name": "p", "interval_seconds": 60, "task": "echo",
                            "payload": {}, "enabled": False},
                           client=None, origin=Schedule.Origin.ADMIN)  # fmt: skip
    assert paused.next_fire_at is None


def test_periodic_takes_the_apis_interval_seconds():
    def handler(payload, ctx): ...

    try:
        periodic.periodic(interval_seconds=30)(handler)
        assert periodic.DECLARED[-1]["interval_seconds"] == 30
        with pytest.deprecated_call(match="interval_seconds"):
            periodic.periodic(interval=45)(handler)
        assert periodic.DECLARED[-1]["interval_seconds"] == 45
    finally:
        periodic.DECLARED[:] = [d for d in periodic.DECLARED if d["handler"] is not handler]
