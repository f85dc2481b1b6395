"""Schedules in the staff console (Django's test client, real PostgreSQL): the list's
next/last run and recent jobs, pause/resume, and the confirmed, audited "run now"."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.urls import reverse

from jobs.models import Job, JobEvent, Schedule, SchedulerRun
from jobs.schedules import define
from jobs.schedules.scheduler import Scheduler
from tests.factories import raw

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:jobs_schedule_changelist"


def staff(client, *codenames: str) -> User:
    user = User.objects.create_user("sam", password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="jobs", codename__in=codenames)
    )
    client.force_login(user)
    return user


def make(name: str = "tick", **values) -> Schedule:
    base = {"name": name, "interval_seconds": 60, "task": "echo", "payload": {"n": 1}}
    return define.create({**base, **values}, client=None, origin=Schedule.Origin.ADMIN)


def act(client, action: str, ids, confirm: bool = True):
    data = {"action": action, "_selected_action": [str(i) for i in ids]}
    if confirm:
        data["post"] = "yes"
    return client.post(reverse(CHANGELIST), data, follow=confirm)


def messages_of(response) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def test_list_shows_next_and_last_run_and_the_detail_recent_jobs(client):
    staff(client, "view_schedule", "view_job")
    s = make()
    raw("UPDATE jobs_schedule SET next_fire_at = now() WHERE id = %s", [s.pk])
    Scheduler().tick()
    job = Job.objects.get(schedule=s)
    s.refresh_from_db()
    page = client.get(reverse(CHANGELIST)).content.decode()
    assert "every 60s" in page and s.last_fire_at.strftime("%Y-%m-%d") in page
    assert f"?schedule__id__exact={s.pk}" in page
    detail = client.get(reverse("admin:jobs_schedule_change", args=[s.pk])).content.decode()
    assert reverse("admin:jobs_job_change", args=[job.pk]) in detail
    jobs = client.get(reverse("admin:jobs_job_changelist"), {"schedule__id__exact": s.pk})
    assert jobs.status_code == 200 and list(jobs.context["cl"].result_list) == [job]
    job_page = client.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
    assert reverse("admin:jobs_schedule_change", args=[s.pk]) in job_page


def test_pause_and_resume_are_audited(client):
    user = staff(client, "view_schedule", "change_schedule")
    s = make()
    r = act(client, "pause_schedules", [s.pk])
    assert messages_of(r) == ["1 schedule paused"]
    s.refresh_from_db()
    assert s.enabled is False
    raw("UPDATE jobs_schedule SET next_fire_at = now() - interval '1 hour' WHERE id = %s", [s.pk])
    assert Scheduler().tick().jobs == 0
    r = act(client, "resume_schedules", [s.pk])
    assert messages_of(r) == ["1 schedule resumed"]
    s.refresh_from_db()
    assert s.enabled is True and s.next_fire_at > raw("SELECT now()")[0][0]
    log = LogEntry.objects.filter(user=user, object_id=str(s.pk)).order_by("id")
    assert [e.change_message for e in log] == ["paused by staff:sam", "resumed by staff:sam"]


def test_run_now_confirms_then_makes_one_job_recorded_everywhere(client):
    user = staff(client, "view_schedule", "run_schedule")
    s = make(overlap="skip")
    confirm = act(client, "run_schedules_now", [s.pk], confirm=False)
    assert confirm.status_code == 200 and b"run-now-schedules" in confirm.content
    assert not Job.objects.exists()
    r = act(client, "run_schedules_now", [s.pk])
    assert messages_of(r) == ["1 job made"]
    job = Job.objects.get(schedule=s)
    run = SchedulerRun.objects.get(schedule=s)
    assert (run.manual, run.job_id, run.fired_by) == (True, job.pk, "staff:sam")
    assert JobEvent.objects.get(job_id=job.pk).actor == "staff:sam"
    entry = LogEntry.objects.get(user=user, object_id=str(s.pk))
    assert entry.change_message == f"Run now by staff:sam: job {job.pk}"
    act(client, "run_schedules_now", [s.pk])  # overlap skip does not stop staff
    assert Job.objects.filter(schedule=s).count() == 2


def test_run_now_needs_its_permission(client):
    staff(client, "view_schedule", "change_schedule")
    s = make()
    r = act(client, "run_schedules_now", [s.pk])
    assert not Job.objects.exists()
    assert r.status_code == 200
    page = client.get(reverse(CHANGELIST)).content.decode()
    assert "run_schedules_now" not in page and "pause_schedules" in page


def test_add_refuses_a_bad_cron_and_writes_nothing(client):
    staff(client, "view_schedule", "add_schedule")
    data = {"name": "bad", "cron": "61 * * * *", "timezone": "UTC", "task": "echo",
            "payload": "{}", "queue": "default", "priority": 0, "catch_up": "skip",
            "overlap": "allow", "enabled": "on"}  # fmt: skip
    r = client.post(reverse("admin:jobs_schedule_add"), data)
    assert r.status_code == 200 and r.context["adminform"].form.errors["cron"]
    assert not Schedule.objects.exists()
    data["cron"] = "0 3 * * *"
    r = client.post(reverse("admin:jobs_schedule_add"), data)
    assert r.status_code == 302, r.context["adminform"].form.errors
    s = Schedule.objects.get(name="bad")
    assert (s.origin, s.cron, s.enabled) == ("admin", "0 3 * * *", True)
    assert s.next_fire_at is not None
