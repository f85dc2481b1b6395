"""Durable jobs and workflows in the staff console: steps and signals on a job, the
audited "send signal" form, and the workflow graph page."""

from __future__ import annotations

import re

import pytest
from django.contrib.admin.models import LogEntry
from django.urls import reverse

from jobs import services, workflows
from jobs.lifecycle import BLOCKED_RUN_AT, WaitReason
from jobs.models import Job, JobSignal, WorkflowNode
from tests.test_admin import make_staff, messages_of

pytestmark = pytest.mark.django_db


def _parked_job() -> Job:
    job, _ = services.submit("echo", {})
    lease = services.claim("w-admin", job.pk)
    assert services.checkpoint_step(lease, "fetch", '{"rows": 3}')
    services.suspend(lease, reason=WaitReason.SIGNAL, key="approval", until=BLOCKED_RUN_AT,
                     checkpoint="~wait:approval")  # fmt: skip
    return Job.objects.get(pk=job.pk)


def test_job_page_shows_its_steps_and_what_it_waits_for(client):
    client.force_login(make_staff("sam", "view_job", "signal_job"))
    job = _parked_job()
    page = client.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
    assert "Steps (checkpoints)" in page and "fetch" in page and "{&quot;rows&quot;: 3}" in page
    assert "~wait:approval" in page  # the wait's own checkpoint
    assert "approval" in page and "Send signal" in page


def test_send_signal_wakes_the_job_and_is_audited(client):
    staff = make_staff("sam", "view_job", "signal_job")
    client.force_login(staff)
    job = _parked_job()
    url = reverse("admin:jobs_job_signal", args=[job.pk])
    assert "waits for the signal “approval”" in client.get(url).content.decode()
    r = client.post(url, {"key": "approval", "payload": '{"ok": true}'}, follow=True)
    assert r.status_code == 200
    assert any("due now" in m for m in messages_of(r))
    signal = JobSignal.objects.get(job_id=job.pk)
    assert (signal.payload, signal.sent_by) == ({"ok": True}, "staff:sam")
    entry = LogEntry.objects.get(object_id=str(job.pk))
    assert (
        entry.user_id == staff.pk and "signal 'approval' sent by staff:sam" in entry.change_message
    )
    assert services.claim("w-admin", job.pk) is not None  # due now
    again = client.post(url, {"key": "approval", "payload": "1"})
    assert again.status_code == 200 and "already has a signal" in again.content.decode()
    bad = client.post(url, {"key": "other", "payload": "{not json"})
    assert "Not JSON" in bad.content.decode()


def test_send_signal_needs_its_permission(client):
    client.force_login(make_staff("viv", "view_job"))
    job = _parked_job()
    page = client.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
    assert "Send signal" not in page
    url = reverse("admin:jobs_job_signal", args=[job.pk])
    assert client.post(url, {"key": "approval", "payload": "1"}).status_code == 403
    assert not JobSignal.objects.exists()


def test_workflow_page_draws_the_graph_with_states_and_links(client):
    client.force_login(make_staff("sam", "view_job"))
    wf = workflows.Workflow("diamond")
    wf.step("a", "echo").step("b", "echo", after=["a"]).step("c", "echo", after=["a"])
    wf.step("d", "echo", after=["b", "c"])
    workflow_id = wf.submit()
    ids = dict(WorkflowNode.objects.filter(workflow_id=workflow_id).values_list("key", "job_id"))
    services.complete([(services.claim("w-admin", ids["a"]), 1)])
    page = client.get(reverse("admin:jobs_workflow_change", args=[workflow_id])).content.decode()
    start = page.index('<svg id="workflow-graph"')
    svg = page[start : page.index("</svg>", start)]
    states = re.findall(r'class="wf-node wf-(\w+)"', svg)
    assert sorted(states) == ["done", "queued", "queued", "queued"]
    assert len(re.findall(r'<line class="wf-edge"', svg)) == 4
    for job_id in ids.values():
        assert reverse("admin:jobs_job_change", args=[job_id]) in svg
    # Columns by depth: a, then b and c, then d.
    xs = {
        m[1]: int(float(m[0]))
        for m in re.findall(r'<rect x="([\d.]+)"[^>]*/><text[^>]*>(\w)<', svg)
    }
    assert xs["a"] < xs["b"] == xs["c"] < xs["d"]
    listing = client.get(reverse("admin:jobs_workflow_changelist")).content.decode()
    assert "diamond" in listing


def test_job_page_shows_the_history_size_and_flags_an_old_open_wait(client, settings):
    client.force_login(make_staff("sam", "view_job"))
    job = _parked_job()  # a step and a signal wait with no timeout
    page = client.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
    assert "1 steps, 1 waits" in page and "of 1000)" in page
    assert "waits for a signal with no timeout" not in page  # a young run
    Job.objects.filter(pk=job.pk).update(created_at="2000-01-01T00:00:00Z")
    page = client.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
    assert "waits for a signal with no timeout" in page
    settings.JOBS_MAX_STEPS = 2
    page = client.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
    assert "continue as new before the limit" in page


def test_job_page_links_the_runs_of_a_continued_job(client):
    client.force_login(make_staff("sam", "view_job"))
    job, _ = services.submit("echo", {})
    lease = services.claim("w-admin", job.pk)
    second = services.continue_as_new(lease, '{"n": 2}')
    page = client.get(reverse("admin:jobs_job_change", args=[second])).content.decode()
    assert "run 2 of chain" in page and f"/jobs/job/{job.pk}/change/" in page
    page = client.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
    assert "continued as" in page and f"/jobs/job/{second}/change/" in page
