"""A failing handler is debuggable (issue 21.2): its exception class and traceback
reach the job's history, the API's history view, the admin's detail page and the
retry confirmation page, and the worker logs the traceback at WARNING."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission, User
from django.urls import reverse
from rest_framework.test import APIClient

from jobs import services
from jobs.models import Client, Job, JobEvent
from tests.harness import wait_until

pytestmark = pytest.mark.slow

ENV = {"JOBS_TASK_MODULES": "demo.tasks,tests.e2e_tasks", "JOBS_RETRY_BACKOFF_BASE": "0.05"}
CARD_CLASS = "tests.e2e_tasks.CardDeclined"
CARD_ERROR = "CardDeclined: card declined: insufficient funds for 42"


@pytest.fixture
def failed_jobs(stack):
    """One permanent failure and one job that spent its retry budget, run by a real worker."""
    owner, token = Client.create_with_token("shop")
    card = services.submit("e2e.card_declined", {"amount": 42}, client_id=owner.pk)[0]
    flaky = services.submit("e2e.value_error", {}, max_retries=1, client_id=owner.pk)[0]
    worker = stack.worker("--concurrency", "2", **ENV)
    wait_until(
        lambda: Job.objects.filter(pk__in=[card.pk, flaky.pk], status="failed").count() == 2,
        30,
        message="both jobs failed",
    )
    return card.pk, flaky.pk, token, worker


def test_traceback_reaches_the_history_table_and_the_log(failed_jobs):
    card, flaky, _, worker = failed_jobs
    ended = JobEvent.objects.get(job_id=card, from_status="processing")
    assert (ended.to_status, ended.error, ended.error_class) == ("failed", CARD_ERROR, CARD_CLASS)
    tb = ended.error_traceback
    assert tb.startswith("Traceback (most recent call last):")
    assert "jobs/worker.py" not in tb  # it starts in the task's own code
    assert re.search(r'e2e_tasks\.py", line \d+, in card_declined', tb)
    assert re.search(r'e2e_tasks\.py", line \d+, in _charge', tb)  # where it was raised
    assert tb.rstrip().endswith(CARD_ERROR.replace("CardDeclined", CARD_CLASS))
    # Each attempt keeps its own: two failed attempts, two tracebacks; no other event has one.
    attempts = JobEvent.objects.filter(job_id=flaky, from_status="processing").order_by("id")
    assert [(e.to_status, e.error_class) for e in attempts] == [
        ("queued", "builtins.ValueError"),
        ("failed", "builtins.ValueError"),
    ]
    assert "ValueError: attempt 1 broke" in attempts[0].error_traceback
    assert "ValueError: attempt 2 broke" in attempts[1].error_traceback
    others = JobEvent.objects.filter(job_id__in=[card, flaky]).exclude(from_status="processing")
    assert not others.filter(error_traceback__isnull=False).exists()
    assert not others.filter(error_class__isnull=False).exists()
    log = worker.output()
    assert re.search(r"WARNING +jobs\.worker: attempt failed: " + re.escape(CARD_ERROR), log)
    assert 'in _charge\n    raise CardDeclined(f"card declined' in log
    assert log.count("Traceback (most recent call last)") == 3  # one per failed attempt


def test_traceback_reaches_the_api_history_view(failed_jobs):
    card, _, token, _ = failed_jobs
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    response = api.get(f"/api/v1/jobs/{card}/history/")
    assert response.status_code == 200
    body = response.json()
    events = body["results"] if isinstance(body, dict) else body
    ended = [e for e in events if e["from_status"] == "processing"]
    assert len(ended) == 1
    assert (ended[0]["error"], ended[0]["error_class"]) == (CARD_ERROR, CARD_CLASS)
    assert "in _charge" in ended[0]["error_traceback"]
    assert [e["error_traceback"] for e in events if e["from_status"] != "processing"] == [None] * (
        len(events) - 1
    )


@pytest.fixture
def staff(client):
    user = User.objects.create_user("sam", password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="jobs"))
    client.force_login(user)
    return client


def test_traceback_reaches_the_admin_detail_page(failed_jobs, staff):
    card, flaky, _, _ = failed_jobs
    html = staff.get(reverse("admin:jobs_job_change", args=[card])).content.decode()
    assert CARD_CLASS in html
    assert "in _charge" in html and "raise CardDeclined(f&quot;card declined" in html
    html = staff.get(reverse("admin:jobs_job_change", args=[flaky])).content.decode()
    assert "ValueError: attempt 1 broke" in html and "ValueError: attempt 2 broke" in html
    assert "2 attempts (1 retry)" in html  # the spent budget, in words


def test_traceback_reaches_the_retry_confirmation_page(failed_jobs, staff):
    card, flaky, _, _ = failed_jobs
    response = staff.post(
        reverse("admin:jobs_job_changelist"),
        {"action": "retry_jobs", "_selected_action": [card, flaky]},
    )
    assert response.status_code == 200
    html = response.content.decode()
    assert "Yes, retry failed jobs" in html  # the confirmation, nothing retried yet
    assert CARD_ERROR in html and CARD_CLASS in html
    assert "in _charge" in html  # the traceback, folded under the error
    assert "2 attempts (1 retry)" in html
    assert Job.objects.get(pk=card).status == "failed"
