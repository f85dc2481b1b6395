"""Flow control per key in one process, against the real database (jobs.flow): the
throttle (a queue's key_rate) at the claim, and debounce, the drop form (rate_limit)
and key strategies at submission. Across processes: tests/test_flow_e2e.py."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction

from jobs import queuecontrol, queues, services
from jobs.exceptions import DebounceConflict, InvalidSubmission, RateLimited
from jobs.models import Debounce, Job, KeyHit, Queue
from jobs.queuecontrol import Gate
from jobs.submission import submit
from tests.factories import ClientFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _db_now():
    with connection.cursor() as cur:
        cur.execute("SELECT statement_timestamp()")
        return cur.fetchone()[0]


def _keyed(n: int, queue: str, key: str, client=None) -> list[int]:
    cid = client.pk if client is not None else None
    return [
        services.submit("echo", {"n": i}, queue=queue, client_id=cid, concurrency_key=key)[0].pk
        for i in range(n)
    ]


# --- the throttle: a queue's key_rate --------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [{"limit": 0, "period": 1}, {"limit": 5}, {"limit": 5, "period": 1.5},
     {"limit": True, "period": 1}, {"limit": 1001, "period": 1}, "5/s",
     {"limit": 1, "period": 86401}, {"limit": 1, "period": 1, "burst": 2}],
)  # fmt: skip
def test_a_bad_key_rate_stops_every_command_at_start(value):
    with pytest.raises(ImproperlyConfigured) as info:
        queues.parse(json.dumps({"default": {}, "crm": {"key_rate": value}}))
    assert "JOBS_QUEUES['crm']" in str(info.value) and "key_rate must be" in str(info.value)


def test_sync_seeds_key_rate_and_removing_it_clears_it():
    queuecontrol.sync({"default": {}, "crm": {"key_rate": {"limit": 3, "period": 60}}})
    row = Queue.objects.get(name="crm")
    assert (row.key_rate_limit, row.key_rate_period, row.limited) == (3, 60, True)
    queuecontrol.sync({"default": {}, "crm": {}})
    row.refresh_from_db()
    assert (row.key_rate_limit, row.key_rate_period) == (None, None)


def test_the_claim_starts_at_most_the_limit_per_key_and_other_keys_pass():
    """3 starts per 60 s per key: 10 jobs of key `a` queued first, then 2 of `b` and 2
    without a key. One claim of 20 takes a's first 3, both of b's and the keyless ones;
    the next claims take nothing of a until its window frees, and say when."""
    queuecontrol.sync({"default": {}, "crm": {"key_rate": {"limit": 3, "period": 60}}})
    a = _keyed(10, "crm", "a")
    b = _keyed(2, "crm", "b")
    free = [services.submit("echo", {}, queue="crm")[0].pk for _ in range(2)]
    assert services.claim_next("w", ["crm"], 5) == []  # the open claim refuses the queue
    got = services.claim_limited_under_queue_lock("w", "crm", 20)
    ids = {x.job_id for x in got.leases}
    assert ids == {*a[:3], *b, *free}
    assert 55 <= got.blocked_for <= 60  # a's next token: its first start + 60 s
    again = services.claim_limited_under_queue_lock("w", "crm", 20)
    assert again.leases == [] and 55 <= again.blocked_for <= 60
    hits = KeyHit.objects.filter(scope="start", queue="crm")
    assert sorted(hits.values_list("key", flat=True)) == ["a", "a", "a", "b", "b"]
    # Another client's `a` is another key.
    other = ClientFactory.create()
    theirs = _keyed(1, "crm", "a", other)
    assert [x.job_id for x in services.claim_limited_under_queue_lock("w", "crm", 5).leases] == (
        theirs
    )


def test_a_start_leaves_the_window_after_its_period_and_a_rollback_uncounts():
    queuecontrol.sync({"default": {}, "crm": {"key_rate": {"limit": 2, "period": 60}}})
    a = _keyed(4, "crm", "a")
    # A claim that rolls back (a crash before commit) counts nothing.
    with pytest.raises(RuntimeError), transaction.atomic():
        assert len(services.claim_limited_under_queue_lock("w", "crm", 5).leases) == 2
        raise RuntimeError("crash")
    assert KeyHit.objects.count() == 0
    first = services.claim_limited_under_queue_lock("w", "crm", 5)
    assert [x.job_id for x in first.leases] == a[:2]
    # Age the window's starts past the period: the key may start again.
    KeyHit.objects.update(at=_db_now() - timedelta(seconds=61))
    second = services.claim_limited_under_queue_lock("w", "crm", 5)
    assert [x.job_id for x in second.leases] == a[2:]
    assert KeyHit.objects.count() == 2  # the aged starts were pruned


def test_the_gate_claims_a_key_rated_queue_under_its_lock_and_waits_for_the_token():
    queuecontrol.sync({"default": {}, "crm": {"key_rate": {"limit": 1, "period": 60}}})
    _keyed(3, "crm", "a")
    gate = Gate()
    assert len(gate.claim_next("w", gate.open(["crm"]), 10)) == 1
    assert gate.held_back("crm") and gate.open(["crm"]) == []  # blocked until the token


def test_key_rate_and_key_concurrency_together_hold_both():
    queuecontrol.sync(
        {"default": {}, "crm": {"key_concurrency": 1, "key_rate": {"limit": 5, "period": 60}}}
    )
    a = _keyed(3, "crm", "a")
    assert [x.job_id for x in services.claim_limited_under_queue_lock("w", "crm", 5).leases] == (
        a[:1]
    )


# --- debounce ---------------------------------------------------------------------------


def test_debounced_submissions_join_one_job_with_the_last_payload():
    first, created = submit("echo", {"n": 1}, debounce_key="doc-1", debounce_seconds=30)
    assert created and first.status == "queued"
    start = _db_now()
    for n in range(2, 6):
        job, created = submit("echo", {"n": n}, debounce_key="doc-1", debounce_seconds=30)
        assert (job.pk, created, job.debounced) == (first.pk, False, True)
    job = Job.objects.get(pk=first.pk)
    assert job.payload == {"n": 5}
    assert start + timedelta(seconds=29) < job.run_at <= _db_now() + timedelta(seconds=30)
    assert Job.objects.count() == 1
    # Not due: no claim takes it.
    assert services.claim_next("w", ["default"], 5) == []


def test_max_wait_bounds_the_delay_from_the_first_submission():
    first, _ = submit("echo", {}, debounce_key="k", debounce_seconds=50, debounce_max_wait=60)
    row = Debounce.objects.get(key="k")
    Debounce.objects.filter(pk=row.pk).update(first_at=row.first_at - timedelta(seconds=30))
    job, _ = submit("echo", {}, debounce_key="k", debounce_seconds=50, debounce_max_wait=60)
    assert job.pk == first.pk
    assert job.run_at == row.first_at - timedelta(seconds=30) + timedelta(seconds=60)


def test_a_started_debounced_job_is_left_alone_and_the_next_submission_makes_another():
    first, _ = submit("echo", {"v": 1}, debounce_key="k", debounce_seconds=0.01)
    Job.objects.filter(pk=first.pk).update(run_at=_db_now() - timedelta(seconds=1))
    (lease,) = services.claim_next("w", ["default"], 1)
    assert lease.job_id == first.pk
    second, created = submit("echo", {"v": 2}, debounce_key="k", debounce_seconds=30)
    assert created and second.pk != first.pk
    assert Job.objects.get(pk=first.pk).payload == {"v": 1}  # never changed once started
    assert Debounce.objects.get(key="k").job_id == second.pk


def test_debounce_keys_are_per_client_and_another_task_under_a_key_is_a_conflict():
    c = ClientFactory.create()
    mine, _ = submit("echo", {}, debounce_key="k", debounce_seconds=30)
    theirs, created = submit("echo", {}, client=c, debounce_key="k", debounce_seconds=30)
    assert created and theirs.pk != mine.pk
    with pytest.raises(DebounceConflict):
        submit("sleep", {"seconds": 0}, debounce_key="k", debounce_seconds=30)
    assert Job.objects.count() == 2


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"debounce_key": "k"}, "debounce_seconds"),
        ({"debounce_seconds": 3}, "debounce_seconds"),
        ({"debounce_key": "k", "debounce_seconds": 0}, "debounce_seconds"),
        ({"debounce_key": "k", "debounce_seconds": 86401}, "debounce_seconds"),
        ({"debounce_key": "k", "debounce_seconds": 5, "debounce_max_wait": 4}, "debounce_max_wait"),
        ({"debounce_key": "has space", "debounce_seconds": 5}, "debounce_key"),
        ({"debounce_key": "k", "debounce_seconds": 5, "unique_key": "u"}, "debounce_key"),
        ({"key_strategy": "skip_new"}, "key_strategy"),
        ({"key_strategy": "newest", "concurrency_key": "c"}, "key_strategy"),
        ({"rate_limit": {"limit": 1, "period": 1}}, "rate_limit"),
        ({"rate_limit": {"limit": 0, "period": 1}, "concurrency_key": "c"}, "rate_limit"),
    ],
)
def test_bad_flow_fields_are_refused_naming_the_field_and_write_nothing(fields, field):
    with pytest.raises(InvalidSubmission) as info:
        submit("echo", {}, **fields)
    assert info.value.field == field
    assert Job.objects.count() == 0 and Debounce.objects.count() == 0


# --- the drop form: a submission's rate_limit -----------------------------------------


def test_rate_limit_refuses_past_the_limit_with_the_seconds_until_one_fits():
    rl = {"limit": 3, "period": 60}
    for _ in range(3):
        submit("echo", {}, concurrency_key="crm", rate_limit=rl)
    with pytest.raises(RateLimited) as info:
        submit("echo", {}, concurrency_key="crm", rate_limit=rl)
    assert 59 <= info.value.retry_after <= 60
    submit("echo", {}, concurrency_key="other", rate_limit=rl)  # another key has its own
    assert Job.objects.count() == 4
    KeyHit.objects.update(at=_db_now() - timedelta(seconds=59.5))
    with pytest.raises(RateLimited) as info:
        submit("echo", {}, concurrency_key="crm", rate_limit=rl)
    assert info.value.retry_after == 1  # whole seconds, at least 1


def test_rate_limit_never_counts_a_replay_nor_a_refusal():
    rl = {"limit": 1, "period": 60}
    c = ClientFactory.create()
    job, _ = submit("echo", {}, client=c, idempotency_key="i1", concurrency_key="k", rate_limit=rl)
    again, created = submit(
        "echo", {}, client=c, idempotency_key="i1", concurrency_key="k", rate_limit=rl
    )
    assert (again.pk, created) == (job.pk, False)
    for _ in range(2):
        with pytest.raises(RateLimited):
            submit("echo", {}, client=c, concurrency_key="k", rate_limit=rl)
    assert KeyHit.objects.filter(scope="submit").count() == 1


# --- key strategies ---------------------------------------------------------------------


def test_skip_new_ends_the_new_job_when_the_key_is_busy():
    busy, _ = submit("echo", {}, concurrency_key="acct", key_strategy="skip_new")
    assert busy.status == "queued" and not busy.skipped
    job, created = submit("echo", {}, concurrency_key="acct", key_strategy="skip_new")
    assert created and job.skipped and job.status == "failed"
    assert job.error == f"skipped: concurrency key busy (job {busy.pk})"
    free, _ = submit("echo", {}, concurrency_key="other", key_strategy="skip_new")
    assert free.status == "queued"


def test_cancel_running_stops_the_running_job_and_cancels_the_queued_ones():
    running, _ = submit("echo", {}, concurrency_key="acct")
    (lease,) = services.claim_next("w", ["default"], 1)
    waiting, _ = submit("echo", {}, concurrency_key="acct")
    new, created = submit("echo", {}, concurrency_key="acct", key_strategy="cancel_running")
    assert created and new.status == "queued"
    running = Job.objects.get(pk=running.pk)
    assert running.status == "processing" and running.cancel_requested_at is not None
    assert Job.objects.get(pk=waiting.pk).status == "failed"


# --- where staff see them ---------------------------------------------------------------


def test_queue_list_shows_the_key_controls(settings, capsys):
    from django.core.management import call_command

    settings.JOBS_QUEUES = {
        "default": {},
        "crm": {"fair": True, "key_concurrency": 2, "key_rate": {"limit": 10, "period": 60}},
    }
    queuecontrol.sync()
    call_command("queue", "list")
    out = capsys.readouterr().out
    assert "crm\tactive" in out
    assert "fair, 2 processing per key, throttle 10/60s per key" in out
    assert next(line for line in out.splitlines() if line.startswith("default")).count("\t") == 3


def test_admin_shows_and_edits_the_throttle_and_refuses_half_of_it(client, settings):
    from django.contrib.auth.models import User
    from django.urls import reverse

    settings.JOBS_QUEUES = {"default": {}, "crm": {"key_rate": {"limit": 10, "period": 60}}}
    queuecontrol.sync()
    client.force_login(User.objects.create_superuser("root", password="pw"))
    listing = client.get(reverse("admin:jobs_queue_changelist"))
    assert listing.status_code == 200 and b"10/60s per key" in listing.content
    url = reverse("admin:jobs_queue_change", args=["crm"])
    half = client.post(url, {"key_rate_limit": "5", "key_rate_period": ""})
    assert half.status_code == 200 and b"queue_key_rate_complete" in half.content
    saved = client.post(url, {"key_rate_limit": "5", "key_rate_period": "30"})
    assert saved.status_code == 302
    row = Queue.objects.get(name="crm")
    assert (row.key_rate_limit, row.key_rate_period) == (5, 30)


def test_django_tasks_take_flow_fields_through_the_flow_context():
    from jobs.backends import flow
    from tests.tasks_app import tasks as app

    with flow(debounce_key="sum", debounce_seconds=30):
        first = app.add.enqueue(1, b=1)
        last = app.add.enqueue(2, b=2)
    assert first.id == last.id
    assert Job.objects.get(pk=int(first.id)).payload == {"args": [2], "kwargs": {"b": 2}}
    with flow(concurrency_key="acct", key_strategy="skip_new"):
        app.add.enqueue(1, b=1)
        skipped = app.add.enqueue(1, b=1)
    assert skipped.status == "FAILED"
