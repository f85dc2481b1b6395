"""The admin console in a real browser: Playwright drives Debian's chromium
(`make browser` installs it) against pytest-django's live server.

Screenshots of the list, the detail page and the dashboard are saved under
test-artifacts/screenshots/ for a person to look at.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission, User
from django.core.cache import cache
from django.db import connection, connections

from jobs import services
from jobs.models import Job, JobEvent
from tests.factories import JobFactory

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "screenshots"

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def page(live_server, monkeypatch):
    """A chromium page logged in as staff member "sam" with every job permission."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(
            f"{CHROMIUM} is missing: the admin browser tests need Debian's chromium. "
            "Run `make browser` (apt-get install -y chromium) or `make test`, which does it."
        )
    # Playwright's sync API runs an event loop in this thread; the ORM calls the test
    # makes between page steps are still plain synchronous calls.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    # The live server's request threads share this settings dict: with no persistent
    # connections, a browser's keep-alive socket cannot leave a session open on the test
    # database when the suite tears it down.
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 0)
    from playwright.sync_api import sync_playwright

    cache.clear()  # the dashboard's few-second cache is per process, shared with the server
    user = User.objects.create_user("sam", password="sam-password", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="jobs"))
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1600, "height": 900})
        tab = context.new_page()
        tab.set_default_timeout(15_000)
        tab.goto(f"{live_server.url}/admin/login/")
        tab.fill("#id_username", "sam")
        tab.fill("#id_password", "sam-password")
        tab.click("input[type=submit]")
        tab.wait_for_url(f"{live_server.url}/admin/")
        tab.base = live_server.url
        yield tab
        context.close()
        browser.close()
        # ORM calls made while Playwright's loop runs get a connection of their own
        # context: close it here, in that context, or it outlives the test database.
        connections.close_all()


def test_filter_failed_and_retry_through_the_confirmation_page(page):
    failed = JobFactory.create(status="failed", task="fail", payload={"message": "boom"})
    JobFactory.create(status="done")
    JobFactory.create(status="processing")

    JobFactory.create(status="enqueue_failed", queue="mail")
    JobFactory.create(queue="mail", priority=5)
    page.goto(f"{page.base}/admin/jobs/job/")
    assert page.locator("#result_list tbody tr").count() == 5
    page.screenshot(path=str(SCREENSHOTS / "admin-job-list.png"), full_page=True)
    page.click("#changelist-filter a[href*='status__exact=failed']")
    page.wait_for_url(re.compile(r"status__exact=failed"))
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 1
    assert "failed" in rows.first.locator(".job-badge").inner_text()
    page.screenshot(path=str(SCREENSHOTS / "admin-job-list-failed.png"), full_page=True)

    page.check(f"input[name=_selected_action][value='{failed.pk}']")
    page.select_option("select[name=action]", "retry_jobs")
    page.click("button[name=index]")
    assert "will be retried" in page.locator("#content-main").inner_text()
    assert page.locator("#eligible-count").inner_text() == "1"
    page.screenshot(path=str(SCREENSHOTS / "admin-retry-confirmation.png"), full_page=True)
    page.click("#confirm-action")

    assert "1 retried" in page.locator("ul.messagelist").inner_text()
    assert Job.objects.get(pk=failed.pk).status == "queued"
    page.goto(f"{page.base}/admin/jobs/job/{failed.pk}/change/")
    assert page.locator(".field-status_badge .job-badge").inner_text() == "queued"
    history = page.locator(".inline-group").inner_text()
    assert "staff:sam" in history and "failed → queued" in history
    page.screenshot(path=str(SCREENSHOTS / "admin-job-detail.png"), full_page=True)


def test_revoke_a_processing_lease_from_the_detail_page(page):
    job, _ = services.submit("sleep", {"seconds": 60})
    lease = services.claim("w-browser", job.pk)
    assert lease.lease_version == 1

    page.goto(f"{page.base}/admin/jobs/job/{job.pk}/change/")
    assert page.locator(".field-lease_version .readonly").inner_text() == "1"
    page.click("button.job-action-revoke")
    assert "fenced off" in page.locator("#content-main").inner_text()
    page.click("#confirm-action")
    assert "1 revoked" in page.locator("ul.messagelist").inner_text()

    page.goto(f"{page.base}/admin/jobs/job/{job.pk}/change/")
    assert page.locator(".field-lease_version .readonly").inner_text() == "2"
    assert page.locator(".field-status_badge .job-badge").inner_text() == "queued"
    assert "staff:sam" in page.locator(".inline-group").inner_text()
    # The worker that held lease 1 is fenced off.
    assert services.complete([(lease, {"late": True})]) == {}
    assert JobEvent.objects.filter(job_id=job.pk, actor="staff:sam").count() == 1


def test_dashboard_from_the_admin_index(page):
    for _ in range(3):
        JobFactory.create(status="done")
    JobFactory.create(status="failed", queue="mail")
    JobFactory.create(status="enqueue_failed", queue="mail")
    JobFactory.create(status="processing")
    JobFactory.create()

    page.goto(f"{page.base}/admin/")
    page.click("#job-dashboard-link a")
    page.wait_for_url(re.compile(r"/admin/jobs/job/dashboard/$"))
    assert page.locator("#card-enqueue-failed .jd-value").inner_text() == "1"
    assert page.locator("#card-done .jd-value").inner_text() == "3"
    assert page.locator("#throughput-chart rect").count() >= 1
    page.screenshot(path=str(SCREENSHOTS / "admin-dashboard.png"), full_page=True)


def _failed_with_traceback(task: str, error: str, error_class: str, frames: str) -> Job:
    """A job whose one attempt failed permanently with a real-looking traceback."""
    job, _ = services.submit(task, {"amount": 42})
    lease = services.claim("w-browser", job.pk)
    tb = f"Traceback (most recent call last):\n{frames}{error_class}: {error.split(': ', 1)[1]}\n"
    services.fail([(lease, error, True, error_class, tb)])
    return Job.objects.get(pk=job.pk)


def test_failed_job_list_shows_the_last_error_and_the_detail_its_traceback(page):
    card = _failed_with_traceback(
        "payments.charge",
        "CardDeclined: card declined: insufficient funds for 42",
        "payments.errors.CardDeclined",
        '  File "payments/tasks.py", line 31, in charge\n    gateway.charge(card, amount)\n'
        '  File "payments/gateway.py", line 88, in charge\n    raise CardDeclined(reply.reason)\n',
    )
    _failed_with_traceback(
        "reports.render",
        "KeyError: 'customer_id' missing from the row of a very long report that goes on",
        "builtins.KeyError",
        '  File "reports/render.py", line 12, in render\n    row["customer_id"]\n',
    )
    JobFactory.create(status="done")

    page.goto(f"{page.base}/admin/jobs/job/?status__exact=failed")
    assert page.locator("#result_list thead").inner_text().count("LAST ERROR") == 1
    errors = page.locator("#result_list tbody td.field-last_error").all_inner_texts()
    assert "CardDeclined: card declined: insufficient funds for 42" in errors
    assert any(e.endswith("…") and len(e) <= 60 for e in errors)  # cut to one short line
    page.screenshot(path=str(SCREENSHOTS / "admin-failed-jobs-errors.png"), full_page=True)

    page.goto(f"{page.base}/admin/jobs/job/{card.pk}/change/")
    history = page.locator(".inline-group")
    assert "payments.errors.CardDeclined" in history.inner_text()
    assert 'payments/gateway.py", line 88, in charge' in history.inner_text()
    page.screenshot(path=str(SCREENSHOTS / "admin-failed-job-traceback.png"), full_page=True)


def test_schedule_pause_resume_and_run_now(page):
    from jobs.models import Schedule, SchedulerRun
    from jobs.schedules import define

    s = define.create(
        {"name": "nightly", "cron": "0 3 * * *", "timezone": "Europe/Berlin", "task": "echo"},
        client=None,
        origin=Schedule.Origin.ADMIN,
    )
    page.goto(f"{page.base}/admin/jobs/schedule/")
    row = page.locator("#result_list tbody tr").first
    assert "0 3 * * * (Europe/Berlin)" in row.inner_text()
    page.screenshot(path=str(SCREENSHOTS / "admin-schedule-list.png"), full_page=True)

    page.check(f"input[name=_selected_action][value='{s.pk}']")
    page.select_option("select[name=action]", "pause_schedules")
    page.click("button[name=index]")
    assert "1 schedule paused" in page.locator("ul.messagelist").inner_text()
    assert "paused" in page.locator("#result_list tbody td.field-next_run").inner_text()
    assert Schedule.objects.get(pk=s.pk).enabled is False

    page.check(f"input[name=_selected_action][value='{s.pk}']")
    page.select_option("select[name=action]", "resume_schedules")
    page.click("button[name=index]")
    assert "1 schedule resumed" in page.locator("ul.messagelist").inner_text()
    assert Schedule.objects.get(pk=s.pk).enabled is True

    page.check(f"input[name=_selected_action][value='{s.pk}']")
    page.select_option("select[name=action]", "run_schedules_now")
    page.click("button[name=index]")
    assert "nightly" in page.locator("#run-now-schedules").inner_text()
    assert not Job.objects.filter(schedule=s).exists()  # nothing before the confirmation
    page.click("input[type=submit][value='Run now']")
    assert "1 job made" in page.locator("ul.messagelist").inner_text()
    job = Job.objects.get(schedule=s)
    assert SchedulerRun.objects.get(schedule=s).manual is True

    page.goto(f"{page.base}/admin/jobs/schedule/{s.pk}/change/")
    assert str(job.pk) in page.locator(".field-recent_jobs").inner_text()
    page.screenshot(path=str(SCREENSHOTS / "admin-schedule-detail.png"), full_page=True)
    page.click(".field-recent_jobs a:has-text('all jobs of this schedule')")
    page.wait_for_url(re.compile(rf"/admin/jobs/job/\?schedule__id__exact={s.pk}$"))
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == 1
