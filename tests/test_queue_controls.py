"""Queue controls in one process: settings, sync, the claims' gates, the command, weights.

The races across workers are in test_queue_controls_e2e.py; here each rule is shown
against the real database with direct calls.
"""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command

from jobs import queuecontrol, queues, services
from jobs.dispatch import parse_queues
from jobs.models import Job, Queue
from jobs.queuecontrol import Gate


@pytest.mark.parametrize(
    "conf,says",
    [
        pytest.param({"concurrency": 0}, "concurrency must be a whole number", id="cap-zero"),
        pytest.param({"concurrency": 2.5}, "concurrency must be a whole number", id="cap-float"),
        pytest.param({"concurrency": True}, "concurrency must be a whole number", id="cap-bool"),
        pytest.param({"rate": "5/d"}, "rate must look like 5/s", id="rate-unit"),
        pytest.param({"rate": "0/s"}, "rate must look like 5/s", id="rate-zero"),
        pytest.param({"rate": "1001/s"}, "rate must look like 5/s", id="rate-too-many"),
        pytest.param({"rate": 5}, "rate must look like 5/s", id="rate-number"),
        pytest.param({"weight": 0}, "weight must be a number in (0, 1000]", id="weight-zero"),
        pytest.param({"weight": "4"}, "weight must be a number", id="weight-text"),
        pytest.param({"paused": "yes"}, "paused must be true or false", id="paused-text"),
    ],
)
def test_a_bad_value_is_refused_with_a_clear_message(conf, says):
    import json

    with pytest.raises(ImproperlyConfigured) as info:
        queues.parse(json.dumps({"default": {}, "partner": conf}))
    assert "JOBS_QUEUES['partner']" in str(info.value) and says in str(info.value)


def test_good_values_parse():
    conf = queues.parse(
        '{"p": {"concurrency": 2, "rate": "5/s", "weight": 4, "paused": true}, '
        '"q": {"rate": "1000/h", "concurrency": null, "rate": null}}'
    )
    assert conf["p"]["rate"] == "5/s"
    assert queues.parse_rate("1000/h") == (1000, 3600)
    assert queues.format_rate(100, 60) == "100/m"


@pytest.mark.django_db(transaction=True)
def test_sync_seeds_rows_and_keeps_staff_edits_across_restarts():
    declared = {"default": {}, "partner": {"concurrency": 2, "rate": "5/s", "paused": True}}
    queuecontrol.sync(declared)
    row = Queue.objects.get(name="partner")
    assert (row.paused, row.concurrency, row.rate_limit, row.rate_period) == (True, 2, 5, 1)
    # Staff resume the queue and raise the cap; a restart with the same JOBS_QUEUES
    # changes nothing.
    Queue.objects.filter(name="partner").update(paused=False, concurrency=5)
    assert queuecontrol.sync(declared) == []
    row.refresh_from_db()
    assert (row.paused, row.concurrency) == (False, 5)
    # A deployment that changes the rate gets its new rate; the staff's cap stays.
    declared["partner"] = {"concurrency": 2, "rate": "10/m", "paused": True}
    assert queuecontrol.sync(declared) == ["partner: rate_limit, rate_period"]
    row.refresh_from_db()
    assert (row.paused, row.concurrency, row.rate_limit, row.rate_period) == (False, 5, 10, 60)
    # A setting removed from JOBS_QUEUES goes back to its default.
    declared["partner"] = {"rate": "10/m", "paused": True}
    queuecontrol.sync(declared)
    row.refresh_from_db()
    assert row.concurrency is None


@pytest.mark.django_db(transaction=True)
def test_open_claim_refuses_a_queue_with_controls_and_the_limited_claim_enforces_them():
    """A worker whose view is stale uses the open claim: it gets nothing from a queue
    with controls. The limited claim gives at most the cap, then the rest of the rate."""
    queuecontrol.sync({"default": {}, "q": {"concurrency": 3, "rate": "4/h"}})
    for _ in range(6):
        services.submit("echo", {}, queue="q")
    assert services.claim_next("w1", ["q"], 10) == []
    job = Job.objects.filter(queue="q").first()
    assert services.claim("w1", job.pk) is None  # nor by id
    first = services.claim_limited_under_queue_lock("w1", "q", 10)
    assert len(first.leases) == 3 and first.blocked_for == services.CAP_RECHECK_SECONDS
    assert services.claim_limited_under_queue_lock("w2", "q", 10).leases == []
    services.complete([(lease, {}) for lease in first.leases])
    second = services.claim_limited_under_queue_lock("w2", "q", 10)
    assert len(second.leases) == 1  # the 4th token of the hour
    assert 3590 < second.blocked_for <= 3600
    assert len(Queue.objects.get(name="q").rate_starts) == 4


@pytest.mark.django_db(transaction=True)
def test_paused_queue_is_claimed_by_neither_claim():
    queuecontrol.sync({"default": {}, "q": {}})
    services.submit("echo", {}, queue="q")
    queuecontrol.set_paused("q", True)
    assert services.claim_next("w", ["q"], 5) == []
    assert services.claim_limited_under_queue_lock("w", "q", 5).leases == []
    queuecontrol.set_paused("q", False)
    assert len(services.claim_next("w", ["q"], 5)) == 1


@pytest.mark.django_db(transaction=True)
def test_queue_command_pauses_resumes_and_refuses_an_unknown_queue(settings, capsys):
    settings.JOBS_QUEUES = {"default": {}, "mail": {}}
    call_command("queue", "pause", "mail")
    assert Queue.objects.get(name="mail").paused
    call_command("queue", "pause", "mail")
    assert "queue mail already paused" in capsys.readouterr().out
    call_command("queue", "resume", "mail")
    assert not Queue.objects.get(name="mail").paused
    with pytest.raises(CommandError, match="unknown queue 'nope': not declared in JOBS_QUEUES"):
        call_command("queue", "pause", "nope")
    call_command("queue", "list")
    assert "mail\tactive" in capsys.readouterr().out


def test_model_weights_fill_in_where_the_worker_gave_none():
    assert parse_queues("a:4,b").with_queues([], {"b": 2.0, "a": 9.0}) == {"a": 4.0, "b": 2.0}
    assert parse_queues("a,b").with_queues([], {"a": 4.0}) == {"a": 4.0, "b": 1.0}
    # `*` without a weight takes the model's; `*:3` is the worker's choice.
    assert parse_queues("*").with_queues(["x", "y"], {"x": 5.0}) == {"x": 5.0, "y": 1.0}
    assert parse_queues("*:3").with_queues(["x"], {"x": 5.0}) == {"x": 3.0}


@pytest.mark.django_db(transaction=True)
def test_gate_skips_paused_and_blocked_queues_and_a_freed_slot_unblocks_a_cap():
    queuecontrol.sync({"default": {}, "cap": {"concurrency": 1}, "held": {"paused": True}})
    for _ in range(2):
        services.submit("echo", {}, queue="cap")
    gate = Gate()
    assert gate.open(["held", "cap", "default"]) == ["cap", "default"]
    leases = gate.claim_next("w", ["cap"], 4)
    assert len(leases) == 1
    assert gate.open(["cap", "default"]) == ["default"]  # blocked: at the cap
    assert 0 < gate.wake_in() <= services.CAP_RECHECK_SECONDS
    services.complete([(leases[0], {})])
    gate.freed(["cap"])
    assert gate.open(["cap"]) == ["cap"]
    assert len(gate.claim_pending("w", ["cap"], 4)) == 1


def _staff(client, *codenames: str):
    from django.contrib.auth.models import Permission, User

    user = User.objects.create_user("queue-staff", password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="jobs", codename__in=codenames)
    )
    client.force_login(user)
    return user


@pytest.mark.django_db
def test_admin_pause_and_resume_are_permissioned_and_audited(client, settings):
    from django.contrib.admin.models import LogEntry
    from django.contrib.messages import get_messages
    from django.urls import reverse

    settings.JOBS_QUEUES = {"default": {}, "mail": {}}
    queuecontrol.sync()
    url = reverse("admin:jobs_queue_changelist")
    viewer = _staff(client, "view_queue")
    page = client.get(url)
    assert page.status_code == 200 and b"pause_queues" not in page.content  # no permission
    viewer.user_permissions.add(*_perms("pause_queue"))
    client.force_login(type(viewer).objects.get(pk=viewer.pk))
    assert b"pause_queues" in client.get(url).content

    done = client.post(url, {"action": "pause_queues", "_selected_action": ["mail"]}, follow=True)
    assert [str(m) for m in get_messages(done.wsgi_request)] == ["1 queue paused"]
    assert Queue.objects.get(name="mail").paused
    entry = LogEntry.objects.get(object_id="mail")
    assert (
        entry.user_id == viewer.pk and "Queue paused by staff:queue-staff" in entry.change_message
    )

    again = client.post(url, {"action": "pause_queues", "_selected_action": ["mail"]}, follow=True)
    assert "1 skipped: already paused" in [str(m) for m in get_messages(again.wsgi_request)][0]
    client.post(url, {"action": "resume_queues", "_selected_action": ["mail"]})
    assert not Queue.objects.get(name="mail").paused
    assert LogEntry.objects.filter(object_id="mail").count() == 2


def _perms(*codenames: str):
    from django.contrib.auth.models import Permission

    return Permission.objects.filter(content_type__app_label="jobs", codename__in=codenames)


@pytest.mark.django_db
def test_dashboard_shows_paused_queues(client, settings):
    from django.contrib.auth.models import User
    from django.core.cache import cache
    from django.urls import reverse

    settings.JOBS_QUEUES = {"default": {}, "mail": {}, "quiet": {}}
    queuecontrol.sync()
    for _ in range(3):
        services.submit("echo", {}, queue="mail")
    queuecontrol.set_paused("mail", True, durable=False)
    queuecontrol.set_paused("quiet", True, durable=False)
    client.force_login(User.objects.create_superuser("root", password="pw"))
    cache.clear()
    page = client.get(reverse("admin:jobs_job_dashboard")).content.decode()
    cache.clear()
    assert 'id="paused-queues"' in page and "2 queues paused" in page
    assert "mail</a> (3 queued)" in page and "quiet</a> (0 queued)" in page
    assert 'class="jd-paused">paused</strong>' in page


@pytest.mark.django_db(transaction=True)
def test_metrics_show_paused_processing_against_the_cap_and_rate_tokens(settings):
    from jobs.collectors import QueueControlsCollector

    settings.JOBS_QUEUES = {"default": {}, "p": {"concurrency": 3, "rate": "5/m"}, "h": {}}
    queuecontrol.sync()
    queuecontrol.set_paused("h", True)
    for _ in range(4):
        services.submit("echo", {}, queue="p")
    assert len(services.claim_limited_under_queue_lock("w", "p", 2).leases) == 2
    samples = {
        (s.name, s.labels["queue"]): s.value
        for family in QueueControlsCollector(cache_seconds=0).collect()
        for s in family.samples
        if s.labels["queue"] in {"default", "p", "h"}  # the suite's other queues have rows too
    }
    assert samples == {
        ("jobs_queue_paused", "default"): 0,
        ("jobs_queue_paused", "h"): 1,
        ("jobs_queue_paused", "p"): 0,
        ("jobs_queue_concurrency_limit", "p"): 3,
        ("jobs_queue_concurrency_used", "p"): 2,
        ("jobs_queue_rate_limit", "p"): 5,
        ("jobs_queue_rate_tokens", "p"): 3,
    }


@pytest.mark.django_db(transaction=True)
def test_a_paused_queue_accepts_submissions_over_the_api(settings):
    import json

    from tests.api.conftest import authed, new_client

    settings.JOBS_QUEUES = {"default": {}, "mail": {}}
    queuecontrol.set_paused("mail", True)
    api = authed(new_client()[1])
    body = {"task": "echo", "payload": 1, "queue": "mail"}
    r = api.post("/api/v1/jobs/", json.dumps(body), content_type="application/json")
    assert r.status_code == 201 and r.json()["status"] == "queued", r.content
    assert services.claim_next("w", ["mail"], 1) == []
    assert Job.objects.get(pk=r.json()["id"]).status == "queued"


@pytest.mark.django_db
def test_admin_edits_limits_and_refuses_half_a_rate(client, settings):
    from django.contrib.auth.models import User
    from django.urls import reverse

    settings.JOBS_QUEUES = {"default": {}, "mail": {}}
    queuecontrol.sync()
    client.force_login(User.objects.create_superuser("root", password="pw"))
    url = reverse("admin:jobs_queue_change", args=["mail"])
    assert client.get(reverse("admin:jobs_queue_changelist")).status_code == 200
    assert client.get(url).status_code == 200
    half = client.post(url, {"concurrency": "2", "rate_limit": "5", "rate_period": ""})
    assert half.status_code == 200 and b"queue_rate_complete" in half.content  # refused
    assert Queue.objects.get(name="mail").rate_limit is None
    saved = client.post(url, {"concurrency": "2", "rate_limit": "5", "rate_period": "1"})
    assert saved.status_code == 302
    row = Queue.objects.get(name="mail")
    assert (row.concurrency, row.rate_limit, row.rate_period) == (2, 5, 1)
