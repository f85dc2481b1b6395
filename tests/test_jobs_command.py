"""`manage.py jobs` against real rows: each verb, its refusals, and the admin and the
command giving the same outcome and the same audit (history row and LogEntry) for the
same action on twin jobs."""

from __future__ import annotations

import getpass
import io
import json
from datetime import timedelta

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import User
from django.contrib.contenttypes.models import ContentType
from django.core.management import CommandError, call_command
from django.urls import reverse
from django.utils import timezone

from jobs import services
from jobs.models import Job, JobEvent
from tests import test_admin
from tests.factories import ClientFactory, JobFactory, raw
from tests.test_admin import ACTION_PERMS, make_staff, messages_of, post_action

pytestmark = pytest.mark.django_db
# The admin tests' fixtures: a cache emptied around each test, and alice, staff with
# every job action, logged in to the admin.
_empty_cache = test_admin._empty_cache
alice = test_admin.alice


def jobs(*args: str, stdin: str | None = None) -> str:
    out = io.StringIO()
    extra = {"stdin": io.StringIO(stdin)} if stdin is not None else {}
    call_command("jobs", *args, stdout=out, **extra)
    return out.getvalue()


def log_entries(job_id: int):
    ct = ContentType.objects.get_for_model(Job)
    return LogEntry.objects.filter(content_type=ct, object_id=str(job_id))


def snapshot(job_id: int) -> dict:
    """What an action leaves: the row's outcome, its last history row and its LogEntry,
    with the job's own id taken out so twin jobs compare equal."""
    row = Job.objects.get(pk=job_id)
    event = JobEvent.objects.filter(job_id=job_id).order_by("-id").first()
    entries = [
        (e.user_id, e.action_flag, e.change_message, e.object_repr.replace(str(job_id), "#"))
        for e in log_entries(job_id)
    ]
    error = (row.error or "").replace(str(job_id), "#")
    return {
        "row": (row.status, error, row.retry_count, row.lease_version, row.owned_by),
        "cancel_requested": row.cancel_requested_at is not None,
        "event": (event.kind, event.from_status, event.to_status, event.actor),
        "log": entries,
    }


# --- the admin and the command, the same action on twin jobs ----------------------

# (verb, the admin action, the state the twins start in)
SAME_ACTIONS = [
    ("retry", "retry_jobs", "failed"),
    ("cancel", "cancel_jobs", "queued"),
    ("cancel", "cancel_jobs", "enqueue_failed"),
    ("cancel", "cancel_running_jobs", "processing"),
    ("revoke", "revoke_jobs", "processing"),
    ("repair", "repair_jobs", "enqueue_failed"),
]


@pytest.mark.parametrize("verb,action,state", SAME_ACTIONS, ids=lambda v: str(v))
def test_the_command_and_the_admin_give_the_same_outcome_and_audit(
    client, alice, verb, action, state
):
    by_admin = JobFactory.create(status=state)
    by_command = JobFactory.create(status=state)
    response = post_action(client, action, [by_admin.pk])
    out = jobs(verb, str(by_command.pk), "--as", "alice")
    assert messages_of(response)[-1] in out  # "1 retried", "1 asked to stop", ...
    admin_side, command_side = snapshot(by_admin.pk), snapshot(by_command.pk)
    assert admin_side == command_side
    assert command_side["event"][3] == "staff:alice"
    [(user_id, flag, message, _)] = command_side["log"]
    assert (user_id, flag) == (alice.pk, CHANGE) and "by staff:alice" in message


def test_a_job_the_action_does_not_apply_to_is_skipped_as_in_the_admin(client, alice):
    by_admin, by_command = JobFactory.create(status="done"), JobFactory.create(status="done")
    response = post_action(client, "retry_jobs", [by_admin.pk])
    out = jobs("retry", str(by_command.pk), "--as", "alice")
    assert out.strip() == messages_of(response)[-1]
    assert out.strip() == "0 retried, 1 skipped: not failed, or its unique key is taken"
    assert snapshot(by_admin.pk) == snapshot(by_command.pk)
    assert not LogEntry.objects.exists()


def test_cancel_takes_queued_and_running_jobs_at_once(alice):
    queued = JobFactory.create()
    running = JobFactory.create(status="processing")
    done = JobFactory.create(status="done")
    out = jobs("cancel", str(queued.pk), str(running.pk), str(done.pk), "--as", "alice")
    assert out.strip() == "1 cancelled, 1 asked to stop, 1 skipped: finished"
    assert Job.objects.get(pk=queued.pk).status == "failed"
    row = Job.objects.get(pk=running.pk)
    assert row.status == "processing" and row.cancel_requested_at is not None
    assert log_entries(queued.pk).count() == 1 and log_entries(running.pk).count() == 1
    assert not log_entries(done.pk).exists()


# --- refusals: what the admin refuses, and bad input --------------------------------


@pytest.mark.parametrize(
    "who,expected",
    [
        (lambda: make_staff("rita", "view_job", "retry_job"), "lacks the permission"),
        (lambda: make_staff("vic", "view_job"), "lacks the permission jobs.cancel_job"),
        (lambda: User.objects.create_user("mallory"), "not an active staff user"),
        (lambda: None, "no user 'nobody'"),
    ],
    ids=["other-permission", "viewer", "not-staff", "unknown"],
)
def test_users_the_admin_refuses_are_refused_and_nothing_changes(who, expected):
    user = who()
    queued = JobFactory.create()
    before = snapshot(queued.pk)
    with pytest.raises(CommandError, match=expected):
        jobs("cancel", str(queued.pk), "--as", user.username if user else "nobody")
    assert snapshot(queued.pk) == before and not LogEntry.objects.exists()


def test_an_inactive_staff_user_is_refused():
    user = make_staff("gone", "view_job", *ACTION_PERMS)
    user.is_active = False
    user.save()
    failed = JobFactory.create(status="failed")
    before = snapshot(failed.pk)
    with pytest.raises(CommandError, match="not an active staff user"):
        jobs("retry", str(failed.pk), "--as", "gone")
    assert snapshot(failed.pk) == before and not LogEntry.objects.exists()


def test_the_os_user_acts_when_no_user_is_named():
    make_staff(getpass.getuser(), "view_job", "retry_job")
    failed = JobFactory.create(status="failed")
    assert jobs("retry", str(failed.pk)).strip() == "1 retried"
    event = JobEvent.objects.filter(job_id=failed.pk).order_by("-id").first()
    assert event.actor == f"staff:{getpass.getuser()}"


def test_an_unknown_id_changes_nothing(alice):
    failed = JobFactory.create(status="failed")
    missing = failed.pk + 1000
    before = snapshot(failed.pk)
    with pytest.raises(CommandError, match=f"no job {missing}; nothing changed"):
        jobs("retry", str(failed.pk), str(missing), "--as", "alice")
    assert snapshot(failed.pk) == before and not LogEntry.objects.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["retry", "abc"],
        ["retry", "0"],
        ["retry", str(2**63)],
        ["list", "--status", "finished"],
        ["list", "--since", "last tuesday"],
        ["list", "--since", "2024-13-01"],
        ["list", "--limit", "0"],
        ["list", "--limit", "1001"],
        ["list", "--queue", "no spaces"],
        ["purge", "bad queue"],
        ["frobnicate"],
    ],
)
def test_bad_arguments_are_refused_by_the_parser(args):
    with pytest.raises(CommandError, match=r"^Error: argument .*(not a|neither|limit|choice)"):
        jobs(*args)


# --- list and show -----------------------------------------------------------------


def test_list_filters_by_status_queue_task_client_and_since():
    acme = ClientFactory.create(name="acme")
    old = JobFactory.create(queue="mail", client_id=acme.pk)
    raw("UPDATE jobs_job SET created_at = now() - interval '3 days' WHERE id = %s", [old.pk])
    mail = JobFactory.create(queue="mail", client_id=acme.pk)
    failed = JobFactory.create(status="failed", task="fail")
    other = JobFactory.create(queue="default")

    def ids(*args: str) -> list[int]:
        return [row["id"] for row in json.loads(jobs("list", "--json", *args))]

    assert ids() == [other.pk, failed.pk, mail.pk, old.pk]  # newest first
    assert ids("--queue", "mail") == [mail.pk, old.pk]
    assert ids("--client", "acme") == [mail.pk, old.pk]
    assert ids("--client", str(acme.pk), "--since", "1d") == [mail.pk]
    since = (timezone.now() - timedelta(days=1)).isoformat()
    assert ids("--queue", "mail", "--since", since) == [mail.pk]
    assert ids("--status", "failed") == [failed.pk]
    assert ids("--status", "failed", "--status", "queued", "--task", "echo") == [
        other.pk,
        mail.pk,
        old.pk,
    ]
    assert ids("--limit", "1") == [other.pk]
    [row] = json.loads(jobs("list", "--json", "--status", "failed"))
    assert row == {
        "id": failed.pk,
        "status": "failed",
        "queue": "default",
        "task": "fail",
        "client": None,
        "retries": "0/3",
        "created_at": row["created_at"],
        "error": "boom",
    }
    text = jobs("list", "--status", "failed").strip()
    assert text.split("\t")[:6] == [str(failed.pk), "failed", "default", "fail", "-", "0/3"]
    assert text.endswith("\tboom")


def test_show_prints_the_error_traceback_and_history():
    job, _ = services.submit("echo", {"n": 1}, max_retries=0)
    lease = services.claim("w-1", job.pk)
    trace = 'Traceback (most recent call last):\n  File "shop.py", line 3\nValueError: nope\n'
    services.fail([(lease, "nope", False, "builtins.ValueError", trace)])
    text = jobs("show", str(job.pk))
    assert "status: failed" in text and "error: nope" in text
    assert "error_class: builtins.ValueError" in text
    assert "traceback:\n" + trace.rstrip() in text
    history = text.split("history:\n", 1)[1].splitlines()
    assert len(history) == 3
    assert "transition new → queued" in history[0]
    assert "queued → processing by worker:w-1 (lease 1" in history[1]
    assert history[2].endswith("processing → failed by worker:w-1 (lease 1, retries 1): nope")

    detail = json.loads(jobs("show", str(job.pk), "--json"))
    assert detail["payload"] == {"n": 1} and detail["error_traceback"] == trace
    assert [(e["from_status"], e["to_status"]) for e in detail["history"]] == [
        (None, "queued"),
        ("queued", "processing"),
        ("processing", "failed"),
    ]
    assert detail["history"][-1]["error_traceback"] == trace


def test_show_an_unknown_job_is_an_error():
    with pytest.raises(CommandError, match="no job 999999"):
        jobs("show", "999999")


# --- purge -------------------------------------------------------------------------


@pytest.fixture
def mail_queue():
    """Two jobs of queue mail waiting, one running, one done; one waiting elsewhere."""
    return {
        "queued": JobFactory.create(queue="mail"),
        "parked": JobFactory.create(queue="mail", status="enqueue_failed"),
        "running": JobFactory.create(queue="mail", status="processing"),
        "done": JobFactory.create(queue="mail", status="done"),
        "elsewhere": JobFactory.create(queue="default"),
    }


def statuses(jobs_by_name: dict[str, Job]) -> dict[str, str]:
    return {name: Job.objects.get(pk=j.pk).status for name, j in jobs_by_name.items()}


BEFORE = {
    "queued": "queued",
    "parked": "enqueue_failed",
    "running": "processing",
    "done": "done",
    "elsewhere": "queued",
}


def test_purge_dry_run_counts_and_changes_nothing(mail_queue):
    out = jobs("purge", "mail", "--dry-run")
    q, p = mail_queue["queued"].pk, mail_queue["parked"].pk
    assert out.strip() == (
        f"would cancel 2 job(s) of queue mail not started (first ids: {q}, {p}); nothing changed"
    )
    assert statuses(mail_queue) == BEFORE and not LogEntry.objects.exists()


@pytest.mark.parametrize("answer", ["no\n", "", "y\n"])
def test_purge_unconfirmed_changes_nothing(alice, mail_queue, answer):
    with pytest.raises(CommandError, match="not confirmed; nothing changed"):
        jobs("purge", "mail", "--as", "alice", stdin=answer)
    assert statuses(mail_queue) == BEFORE and not LogEntry.objects.exists()


@pytest.mark.parametrize("confirm", [["--yes"], []], ids=["yes-flag", "typed-yes"])
def test_purge_cancels_the_queues_jobs_not_started_as_the_admin_cancel(
    client, alice, mail_queue, confirm
):
    out = jobs("purge", "mail", "--as", "alice", *confirm, stdin="yes\n")
    assert out.strip().endswith("2 cancelled in queue mail")
    assert statuses(mail_queue) == {**BEFORE, "queued": "failed", "parked": "failed"}
    # The admin's cancel on a twin job leaves the same row, history and LogEntry.
    twin = JobFactory.create(queue="mail")
    post_action(client, "cancel_jobs", [twin.pk])
    assert snapshot(mail_queue["queued"].pk) == snapshot(twin.pk)
    assert log_entries(mail_queue["parked"].pk).count() == 1
    assert not log_entries(mail_queue["running"].pk).exists()


def test_purge_needs_the_cancel_permission(mail_queue):
    make_staff("vic", "view_job", "retry_job")
    with pytest.raises(CommandError, match="lacks the permission jobs.cancel_job"):
        jobs("purge", "mail", "--as", "vic", "--yes")
    assert statuses(mail_queue) == BEFORE


def test_purging_an_empty_queue_says_so():
    assert jobs("purge", "idle", "--yes").strip() == (
        "no job of queue idle waits to start; nothing to purge"
    )


def test_the_admin_changelist_still_lists_what_the_command_lists(client, alice):
    """The command reads what the admin reads: a job the list shows opens in the admin."""
    job = JobFactory.create(status="failed")
    [row] = json.loads(jobs("list", "--json", "--status", "failed"))
    page = client.get(reverse("admin:jobs_job_change", args=[row["id"]]))
    assert page.status_code == 200 and str(job.pk) in page.content.decode()
