"""The latency SLO counts from when a job is due, max(created_at, run_at) (SPEC §6):
a job scheduled for later does not count its scheduled wait, in the histogram,
in `manage.py slo` and on the admin dashboard alike."""

from __future__ import annotations

import io
import time
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.core.cache import cache
from django.core.management import call_command
from django.db.models.functions import Now
from django.urls import reverse
from django.utils import timezone

from jobs import metrics, services
from jobs.models import Job
from tests.factories import raw

pytestmark = pytest.mark.django_db(transaction=True)

HOUR = timedelta(hours=1)
WAIT = 400  # seconds between submission and run_at: far past the 25 s SLO


def _histogram(task: str) -> tuple[float, float]:
    """(count, sum) of jobs_time_to_terminal_seconds for `task`'s done jobs."""
    child = metrics.TIME_TO_TERMINAL.labels("default", task, "done")
    samples = {s.name: s.value for m in child.collect() for s in m.samples}
    name = "jobs_time_to_terminal_seconds"
    return samples[f"{name}_count"], samples[f"{name}_sum"]


@pytest.fixture
def scheduled_done():
    """A job submitted WAIT seconds before its run_at, done just after it became due.

    Submitted with run_at a moment ahead, then its submission moved WAIT seconds back
    (a job scheduled long in advance), then claimed and completed once due.
    """
    cache.clear()
    task = "echo"
    before = _histogram(task)
    job, _ = services.submit(task, {}, run_at=None)
    raw(
        "UPDATE jobs_job SET created_at = created_at - %s * interval '1 second',"
        " run_at = created_at WHERE id = %s",
        [WAIT, job.pk],
    )
    # What submit would have written for such a job (the insert trigger sets due_at).
    raw("UPDATE jobs_job SET due_at = run_at WHERE id = %s", [job.pk])
    lease = services.claim("w-slo", job.pk)
    time.sleep(0.05)
    services.complete([(lease, {"ok": True})])
    row = Job.objects.annotate(now=Now()).get(pk=job.pk)
    assert row.finished_at - row.created_at > timedelta(seconds=WAIT)
    yield job, before, _histogram(task)
    cache.clear()


def test_scheduled_submission_sets_due_at_to_run_at():
    """The insert trigger: due at run_at when later than submission, else at submission."""
    now, _ = services.submit("echo", {})
    later = services.submit_many([services.NewJob("echo", {}, run_at=timezone.now() + HOUR)])
    batch_now = services.submit_many([services.NewJob("echo", {})])
    rows = raw(
        "SELECT id, due_at = created_at, due_at = run_at, run_at <= created_at FROM jobs_job"
        " WHERE id = ANY(%s)",
        [[now.pk, later[0].job_id, batch_now[0].job_id]],
    )
    # An immediate job's run_at is its transaction's now(): the statement's created_at or
    # (a prepared statement's transaction starts at its Bind message) microseconds before.
    got = {r[0]: r[1:] for r in rows}
    assert got[later[0].job_id] == (False, True, False)  # due at run_at, after creation
    for immediate in (now.pk, batch_now[0].job_id):
        due_at_creation, _, run_at_not_after_creation = got[immediate]
        assert due_at_creation and run_at_not_after_creation, got


def test_histogram_counts_from_run_at(scheduled_done):
    _, before, after = scheduled_done
    assert after[0] == before[0] + 1
    observed = after[1] - before[1]
    print(f"\nobserved latency {observed:.3f}s for a job submitted {WAIT}s before run_at")
    assert 0 <= observed < 25


def test_slo_command_counts_from_run_at(scheduled_done):
    out = io.StringIO()
    call_command("slo", "--window", "1h", stdout=out)
    text = out.getvalue()
    assert "SLO: 100.00% terminal within 25s" in text, text
    p99 = float(text.split("p99 ")[1].rstrip("s\n"))
    assert p99 < 25, text


def test_admin_dashboard_counts_from_run_at(scheduled_done, client):
    user = User.objects.create_user("dora", password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename="view_job"))
    client.force_login(user)
    response = client.get(reverse("admin:jobs_job_dashboard"))
    assert response.status_code == 200
    board = response.context["board"]
    assert board.latency_p99 is not None and board.latency_p99 < 25, board
    assert board.attainment == 1.0, board
