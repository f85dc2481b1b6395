"""Sequences and batches in the staff console (jobs.admin.flow): a key's page, the
audited resume and skip actions, a batch's progress."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.urls import reverse

from jobs import services, submission
from jobs.flow import batches
from jobs.models import Batch, Job, Sequence
from tests.test_admin import make_staff, messages_of

pytestmark = pytest.mark.django_db(transaction=True)


def _halted(key: str) -> list[int]:
    ids = [submission.submit("echo", {"i": i}, sequence_key=key)[0].pk for i in range(3)]
    lease = services.claim("w-admin", ids[0])
    services.fail([(lease, "boom", True)])
    return ids


def test_a_keys_page_and_the_list_show_the_halt(client):
    client.force_login(make_staff("sam", "view_job"))
    ids = _halted("acct-1")
    seq = Sequence.objects.get(key="acct-1")
    listing = client.get(reverse("admin:jobs_sequence_changelist")).content.decode()
    assert "acct-1" in listing and "halted" in listing
    page = client.get(reverse("admin:jobs_sequence_change", args=[seq.pk])).content.decode()
    assert "halted" in page
    assert reverse("admin:jobs_job_change", args=[ids[0]]) in page
    assert reverse("admin:jobs_job_change", args=[ids[2]]) in page  # waiting, in order
    assert "Resume" not in listing  # no retry permission, no action


@pytest.mark.parametrize("action,runs", [("resume_sequences", 0), ("skip_failed_jobs", 1)])
def test_resume_and_skip_are_audited_actions(client, action, runs):
    client.force_login(make_staff("sam", "view_job", "retry_job"))
    ids = _halted("acct-2")
    seq = Sequence.objects.get(key="acct-2")
    r = client.post(reverse("admin:jobs_sequence_changelist"),
                    {"action": action, "_selected_action": [seq.pk]}, follow=True)  # fmt: skip
    assert any("1 sequence(s)" in m for m in messages_of(r)), messages_of(r)
    seq.refresh_from_db()
    assert (seq.halted_job_id, seq.active_job_id) == (None, ids[runs])
    assert Job.objects.get(pk=ids[runs]).wait_reason is None
    assert LogEntry.objects.filter(object_id=str(seq.pk)).exists()
    # Again: not halted any more, said so, nothing changed.
    r = client.post(reverse("admin:jobs_sequence_changelist"),
                    {"action": action, "_selected_action": [seq.pk]}, follow=True)  # fmt: skip
    assert any("not halted" in m for m in messages_of(r))


def test_a_batch_page_shows_progress_and_callbacks(client):
    client.force_login(make_staff("sam", "view_job"))
    batch_id, _ = batches.create(
        [{"task": "echo", "payload": {}} for _ in range(2)],
        {"on_complete": batches.task_callback("echo")},
        name="thumbs",
    )
    listing = client.get(reverse("admin:jobs_batch_changelist")).content.decode()
    assert "thumbs" in listing and "0/2" in listing
    page = client.get(reverse("admin:jobs_batch_change", args=[batch_id])).content.decode()
    assert "on_complete: echo" in page
    assert Batch.objects.get(pk=batch_id).pending == 2
