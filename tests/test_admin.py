"""The staff console through Django's test client: read-only jobs, every action
with its confirmation, refusals, audit (history + LogEntry), select-across and
permissions. Real PostgreSQL and Redis throughout."""

from __future__ import annotations

import pytest
from django.contrib.admin import site as admin_site
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.contrib.messages import get_messages
from django.core.cache import cache
from django.urls import reverse

from jobs import services
from jobs.admin.options import JobAdmin
from jobs.admin.paginator import CappedCountPaginator
from jobs.models import Client, Job, JobEvent
from jobs.selectors import capped_count
from jobs.transport import get_transport
from tests.factories import ClientFactory, JobFactory, raw

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:jobs_job_changelist"
ACTION_PERMS = ["retry_job", "repair_job", "revoke_job", "cancel_job", "cancel_running_job"]


@pytest.fixture(autouse=True)
def _empty_cache():
    """The dashboard and the queue filter cache for seconds; tests start without."""
    cache.clear()
    yield
    cache.clear()


def make_staff(username: str, *codenames: str, superuser: bool = False) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.is_superuser = superuser
    user.save()
    if codenames:
        user.user_permissions.set(
            Permission.objects.filter(content_type__app_label="jobs", codename__in=codenames)
        )
    return User.objects.get(pk=user.pk)  # fresh permission cache


@pytest.fixture
def alice(client):
    """Staff with view access and every job action."""
    user = make_staff("alice", "view_job", "view_client", *ACTION_PERMS)
    client.force_login(user)
    return user


@pytest.fixture
def viewer(client):
    """Staff who may look but not act."""
    user = make_staff("victor", "view_job", "view_client")
    client.force_login(user)
    return user


def messages_of(response) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def post_action(client, action, ids, *, confirm=True, url=None, select_across=False, **extra):
    data = {"action": action, "_selected_action": [str(i) for i in ids], **extra}
    if select_across:
        data["select_across"] = "1"
    if confirm:
        data["post"] = "yes"
    return client.post(url or reverse(CHANGELIST), data, follow=confirm)


def status(job_id: int) -> str:
    return Job.objects.values_list("status", flat=True).get(pk=job_id)


def last_event(job_id: int) -> JobEvent:
    return JobEvent.objects.filter(job_id=job_id).order_by("-id").first()


def log_entries(job_id: int):
    ct = ContentType.objects.get_for_model(Job)
    return LogEntry.objects.filter(content_type=ct, object_id=str(job_id))


# --- access --------------------------------------------------------------------------


def test_only_staff_reach_the_admin(client):
    user = User.objects.create_user("mallory", password="pw")  # not staff
    client.force_login(user)
    for url in [reverse(CHANGELIST), reverse("admin:jobs_job_dashboard"), reverse("admin:index")]:
        response = client.get(url)
        assert response.status_code == 302
        assert response["Location"].startswith(reverse("admin:login"))


def test_staff_without_view_permission_gets_403(client):
    client.force_login(make_staff("nobody"))
    assert client.get(reverse(CHANGELIST)).status_code == 403
    assert client.get(reverse("admin:jobs_job_dashboard")).status_code == 403


# --- the list ------------------------------------------------------------------------


def test_list_shows_badges_and_columns(client, alice):
    acme = ClientFactory.create(name="acme")
    failed = JobFactory.create(status="failed", client_id=acme.pk, queue="mail")
    running = JobFactory.create(status="processing")
    response = client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    html = response.content.decode()
    assert 'class="job-badge job-badge-failed"' in html
    assert 'class="job-badge job-badge-processing"' in html
    assert "0 of 3 retries" in html  # retry_count of max_retries
    assert "w-factory" in html  # owner of the processing job
    assert "acme" in html
    rows = {j.pk: j for j in response.context["cl"].result_list}
    assert set(rows) == {failed.pk, running.pk}
    assert rows[running.pk].lease_version == 1
    assert reverse("admin:jobs_job_add") not in html  # no add button
    assert reverse("admin:jobs_job_dashboard") in html  # object tool


def test_list_does_not_count_the_whole_table(client, alice, django_assert_max_num_queries):
    JobFactory.create()
    with django_assert_max_num_queries(8):
        response = client.get(reverse(CHANGELIST))
    cl = response.context["cl"]
    assert cl.full_result_count is None  # show_full_result_count = False
    assert isinstance(cl.paginator, CappedCountPaginator)


def _ids(response) -> set[int]:
    return {j.pk for j in response.context["cl"].result_list}


def test_filters_status_task_queue_client_and_stuck(client, alice, settings):
    settings.JOBS_LEASE_SECONDS = 15
    acme = ClientFactory.create()
    failed = JobFactory.create(status="failed", task="fail")
    echo_high = JobFactory.create(queue="high", client_id=acme.pk)
    fresh = JobFactory.create(status="processing")
    stale = JobFactory.create(status="processing")
    raw(
        "UPDATE jobs_job SET heartbeat_at = now() - interval '16 seconds' WHERE id = %s",
        [stale.pk],
    )
    url = reverse(CHANGELIST)
    assert _ids(client.get(url, {"status__exact": "failed"})) == {failed.pk}
    assert _ids(client.get(url, {"task": "fail"})) == {failed.pk}
    assert _ids(client.get(url, {"queue": "high"})) == {echo_high.pk}
    assert _ids(client.get(url, {"client__id__exact": acme.pk})) == {echo_high.pk}
    assert _ids(client.get(url, {"stuck": "yes"})) == {stale.pk}
    assert fresh.pk not in _ids(client.get(url, {"stuck": "yes"}))
    # The task filter offers registered tasks, the queue filter queues with live or
    # recent jobs — neither reads DISTINCT over the table.
    html = client.get(url).content.decode()
    assert "?task=sleep" in html
    assert "?queue=high" in html


def test_facet_counts_are_never_computed(client, alice):
    JobFactory.create()
    response = client.get(reverse(CHANGELIST), {"_facets": "True"})
    assert response.status_code == 200
    assert response.context["cl"].add_facets is False
    assert "Show counts" not in response.content.decode()


def test_search_is_exact_on_id_and_idempotency_key(client, alice):
    acme = ClientFactory.create()
    keyed = JobFactory.create(client_id=acme.pk, idempotency_key="order-42")
    anonymous = JobFactory.create(idempotency_key="order-43")
    other = JobFactory.create()
    url = reverse(CHANGELIST)
    assert _ids(client.get(url, {"q": str(other.pk)})) == {other.pk}
    assert _ids(client.get(url, {"q": "order-42"})) == {keyed.pk}
    assert _ids(client.get(url, {"q": "order-43"})) == {anonymous.pk}
    assert _ids(client.get(url, {"q": "order-4"})) == set()  # no substring search
    assert _ids(client.get(url, {"q": "99999999999999999999"})) == set()  # not an id


def test_count_is_capped_and_then_estimated(client, alice, monkeypatch):
    for _ in range(6):
        JobFactory.create(status="failed")
    JobFactory.create()
    assert capped_count(Job.objects.all(), cap=10) == (7, True)
    n, exact = capped_count(Job.objects.filter(status="failed"), cap=3)
    assert not exact and n >= 4
    raw("ANALYZE jobs_job")
    n, exact = capped_count(Job.objects.all(), cap=3)
    assert (n, exact) == (7, False)  # pg_class.reltuples after ANALYZE
    monkeypatch.setattr(CappedCountPaginator, "cap", 3)
    # Every job listed (no filter): the table's reltuples, 7 after the ANALYZE.
    assert paginator_words(client.get(reverse(CHANGELIST), {"internal": "all"})) == [
        "about", "7", "jobs", "(estimated)"
    ]  # fmt: skip
    # The default list hides internal tasks, a filter: EXPLAIN's estimate, at least cap + 1
    # and otherwise the planner's (10 seen after other tests' partitions and statistics).
    words = paginator_words(client.get(reverse(CHANGELIST)))
    assert words[0] == "about" and int(words[1]) >= 4 and words[2:] == ["jobs", "(estimated)"]


def paginator_words(response) -> list[str]:
    html = response.content.decode()
    return html.partition('<p class="paginator">')[2].partition("</p>")[0].split()


def test_wide_sorts_only_on_narrowed_lists(rf, alice):
    model_admin = JobAdmin(Job, admin_site)
    request = rf.get("/")
    assert set(model_admin.get_sortable_by(request)) == {"id", "age"}
    request = rf.get("/", {"status__exact": "failed"})
    assert "in_state" in model_admin.get_sortable_by(request)


# --- the detail page -------------------------------------------------------------------


def test_detail_is_read_only_with_pretty_json_and_history(client, alice):
    job, _ = services.submit("echo", {"b": 1, "a": [1, 2]}, actor="api")
    lease = services.claim("w-1", job.pk)
    services.fail([(lease, "transient", False)])
    url = reverse("admin:jobs_job_change", args=[job.pk])
    response = client.get(url)
    assert response.status_code == 200
    html = response.content.decode()
    assert 'name="_save"' not in html  # no save button
    assert "<pre" in html and "&quot;a&quot;: [\n    1,\n    2\n  ]" in html  # pretty-printed
    events = list(response.context["inline_admin_formsets"][0].formset.queryset)
    assert [(e.from_status, e.to_status, e.actor) for e in events] == [
        (None, "queued", "api"),
        ("queued", "processing", "worker:w-1"),
        ("processing", "queued", "worker:w-1"),
    ]
    assert "worker:w-1" in html and "transient" in html
    # Staff never write job fields by hand: the change form refuses a POST.
    before = raw("SELECT status, lease_version, owned_by FROM jobs_job WHERE id = %s", [job.pk])
    forged = client.post(url, {"status": "done", "lease_version": "0", "owned_by": "x"})
    assert forged.status_code == 403
    after = raw("SELECT status, lease_version, owned_by FROM jobs_job WHERE id = %s", [job.pk])
    assert before == after
    assert client.get(reverse("admin:jobs_job_add")).status_code == 403
    assert client.post(reverse("admin:jobs_job_delete", args=[job.pk])).status_code == 403
    assert Job.objects.filter(pk=job.pk).exists()


def test_detail_offers_only_the_actions_that_apply(client, alice, viewer):
    failed = JobFactory.create(status="failed")
    client.force_login(alice)
    html = client.get(reverse("admin:jobs_job_change", args=[failed.pk])).content.decode()
    assert 'value="retry_jobs"' in html
    assert 'value="revoke_jobs"' not in html and 'value="cancel_jobs"' not in html
    client.force_login(viewer)
    html = client.get(reverse("admin:jobs_job_change", args=[failed.pk])).content.decode()
    assert 'value="retry_jobs"' not in html


# --- actions -----------------------------------------------------------------------------


def test_retry_confirms_then_requeues_failed_and_skips_done(client, alice):
    failed = JobFactory.create(status="failed")
    done = JobFactory.create(status="done")
    raw("UPDATE jobs_job SET retry_count = 4 WHERE id = %s", [failed.pk])

    page = post_action(client, "retry_jobs", [failed.pk, done.pk], confirm=False)
    assert page.status_code == 200
    assert page.templates[0].name == "admin/jobs/job/action_confirmation.html"
    html = page.content.decode()
    assert page.context["selected_count"] == 2
    assert page.context["eligible_count"] == 1
    assert 'id="eligible-count">1<' in html and 'id="skipped-count">1<' in html
    assert "retry_count reset to 0" in html
    assert status(failed.pk) == "failed"  # nothing happens before confirmation

    response = post_action(client, "retry_jobs", [failed.pk, done.pk])
    assert messages_of(response) == ["1 retried, 1 skipped: not failed, or its unique key is taken"]
    row = Job.objects.get(pk=failed.pk)
    assert (row.status, row.retry_count, row.finished_at, row.result) == ("queued", 0, None, None)
    event = last_event(failed.pk)
    assert (event.from_status, event.to_status, event.actor) == ("failed", "queued", "staff:alice")
    entry = log_entries(failed.pk).get()
    assert (entry.user_id, entry.action_flag) == (alice.pk, CHANGE)
    assert "staff:alice" in entry.change_message
    assert status(done.pk) == "done" and not log_entries(done.pk).exists()


def test_retrying_only_a_done_job_changes_nothing(client, alice):
    done = JobFactory.create(status="done")
    events = JobEvent.objects.count()
    response = post_action(client, "retry_jobs", [done.pk])
    assert messages_of(response) == ["0 retried, 1 skipped: not failed, or its unique key is taken"]
    assert status(done.pk) == "done"
    assert JobEvent.objects.count() == events
    assert not LogEntry.objects.exists()


def test_repair_requeues_and_resignals_enqueue_failed(
    client, alice, django_capture_on_commit_callbacks
):
    parked = JobFactory.create(status="enqueue_failed", queue="repairq")
    queued = JobFactory.create(queue="repairq")
    transport = get_transport()
    transport.pop(["repairq"], timeout=0.1, count=100)  # drop the submission signals
    with django_capture_on_commit_callbacks(execute=True):
        response = post_action(client, "repair_jobs", [parked.pk, queued.pk])
    assert messages_of(response) == ["1 repaired, 1 skipped: not enqueue_failed"]
    assert status(parked.pk) == "queued"
    assert transport.pop(["repairq"], timeout=0.5, count=10) == ("repairq", [parked.pk])
    event = last_event(parked.pk)
    assert (event.from_status, event.to_status, event.actor) == (
        "enqueue_failed",
        "queued",
        "staff:alice",
    )
    assert log_entries(parked.pk).count() == 1 and not log_entries(queued.pk).exists()


def test_revoke_fences_off_the_running_worker(client, alice):
    job, _ = services.submit("echo", {})
    lease = services.claim("w-slow", job.pk)
    assert lease.lease_version == 1
    idle = JobFactory.create()
    page = post_action(client, "revoke_jobs", [job.pk, idle.pk], confirm=False)
    assert page.context["eligible_count"] == 1 and "fenced off" in page.content.decode()
    response = post_action(client, "revoke_jobs", [job.pk, idle.pk])
    assert messages_of(response) == ["1 revoked, 1 skipped: not processing"]
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.lease_version, row.owned_by, row.retry_count) == ("queued", 2, None, 0)
    assert row.error == "lease revoked by staff:alice"
    # The worker that still believes it holds lease 1 can no longer write.
    assert services.heartbeat([lease]) == set()
    assert services.complete([(lease, {"late": True})]) == {}
    assert status(job.pk) == "queued"
    event = last_event(job.pk)
    assert (event.to_status, event.actor, event.lease_version) == ("queued", "staff:alice", 2)
    assert log_entries(job.pk).count() == 1
    assert status(idle.pk) == "queued" and not log_entries(idle.pk).exists()


def test_cancel_only_touches_jobs_not_started(client, alice):
    queued = JobFactory.create()
    parked = JobFactory.create(status="enqueue_failed")
    running = JobFactory.create(status="processing")
    response = post_action(client, "cancel_jobs", [queued.pk, parked.pk, running.pk])
    assert messages_of(response) == ["2 cancelled, 1 skipped: already started or finished"]
    for job in (queued, parked):
        row = Job.objects.get(pk=job.pk)
        assert (row.status, row.error) == ("failed", "cancelled")
        assert last_event(job.pk).actor == "staff:alice"
        assert log_entries(job.pk).count() == 1
    assert status(running.pk) == "processing"


def test_select_across_acts_on_every_matching_page_in_chunks(client, alice, monkeypatch):
    monkeypatch.setattr(JobAdmin, "action_chunk_size", 40)
    failed = [JobFactory.create(status="failed").pk for _ in range(130)]
    done = JobFactory.create(status="done")
    url = reverse(CHANGELIST) + "?status__exact=failed"
    listing = client.get(url)
    page_ids = [j.pk for j in listing.context["cl"].result_list]
    assert len(page_ids) == 100  # one page shows 100 of the 130
    assert "Select all 130 matching jobs" in listing.content.decode()

    page = post_action(client, "retry_jobs", page_ids, confirm=False, url=url, select_across=True)
    assert page.context["selected_count"] == 130 and page.context["eligible_count"] == 130
    assert 'name="select_across" value="1"' in page.content.decode()

    response = post_action(client, "retry_jobs", page_ids, url=url, select_across=True)
    assert messages_of(response) == ["130 retried"]
    assert Job.objects.filter(pk__in=failed, status="queued").count() == 130
    assert LogEntry.objects.filter(user=alice).count() == 130
    assert JobEvent.objects.filter(job_id__in=failed, actor="staff:alice").count() == 130
    assert status(done.pk) == "done"  # outside the filter: untouched


def test_select_across_without_filter_counts_the_skipped(client, alice):
    failed = JobFactory.create(status="failed")
    others = [JobFactory.create(status=s).pk for s in ("done", "queued", "processing")]
    response = post_action(client, "retry_jobs", [failed.pk], select_across=True)
    assert messages_of(response) == ["1 retried, 3 skipped: not failed, or its unique key is taken"]
    assert [status(i) for i in others] == ["done", "queued", "processing"]


# --- permissions ----------------------------------------------------------------------------


def test_cancel_running_confirms_then_records_a_request(client, alice):
    job, _ = services.submit("echo", {})
    lease = services.claim("w-slow", job.pk)
    idle = JobFactory.create()
    page = post_action(client, "cancel_running_jobs", [job.pk, idle.pk], confirm=False)
    assert page.status_code == 200
    assert page.templates[0].name == "admin/jobs/job/action_confirmation.html"
    assert page.context["eligible_count"] == 1
    assert "next heartbeat" in page.content.decode()
    assert Job.objects.get(pk=job.pk).cancel_requested_at is None  # nothing before confirming

    response = post_action(client, "cancel_running_jobs", [job.pk, idle.pk])
    assert messages_of(response) == ["1 asked to stop, 1 skipped: not processing"]
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.lease_version, row.owned_by) == ("processing", 1, "w-slow")
    assert row.cancel_requested_at is not None
    event = last_event(job.pk)
    assert (event.kind, event.actor) == ("cancel_requested", "staff:alice")
    entry = log_entries(job.pk).get()
    assert (entry.user_id, entry.action_flag) == (alice.pk, CHANGE)
    assert "staff:alice" in entry.change_message
    # The worker learns it with its next heartbeat; the lease itself still holds.
    assert services.heartbeat([lease]).cancel_requested == {(job.pk, 1)}
    assert status(idle.pk) == "queued" and not log_entries(idle.pk).exists()


def test_progress_bar_in_the_list_and_message_on_the_detail(client, alice):
    job, _ = services.submit("echo", {})
    lease = services.claim("w-1", job.pk)
    services.heartbeat([lease], [{"done": 30, "total": 40, "message": "resizing <b>"}])
    html = client.get(reverse(CHANGELIST)).content.decode()
    assert '<progress class="job-progress" value="0.75" max="1"' in html and "75%" in html
    detail = client.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
    assert "30 of 40 (75%)" in detail and "resizing &lt;b&gt;" in detail
    assert 'value="cancel_running_jobs"' in detail


def test_viewer_sees_no_actions_and_forged_posts_change_nothing(client, viewer):
    failed = JobFactory.create(status="failed")
    running = JobFactory.create(status="processing")
    response = client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    html = response.content.decode()
    for name in ("retry_jobs", "repair_jobs", "revoke_jobs", "cancel_jobs", "cancel_running_jobs"):
        assert f'value="{name}"' not in html
    events = JobEvent.objects.count()
    for action, job in [
        ("retry_jobs", failed),
        ("revoke_jobs", running),
        ("cancel_running_jobs", running),
    ]:
        # With no action allowed, Django ignores the POST and shows the list again.
        for confirm in (True, False):
            response = post_action(client, action, [job.pk], confirm=confirm)
            assert response.status_code == 200
            assert response.templates[0].name == "admin/jobs/job/change_list.html"
    assert status(failed.pk) == "failed"
    row = Job.objects.get(pk=running.pk)
    assert (row.status, row.lease_version, row.owned_by) == ("processing", 1, "w-factory")
    assert JobEvent.objects.count() == events
    assert not LogEntry.objects.exists()


def test_each_action_has_its_own_permission(client):
    user = make_staff("rita", "view_job", "retry_job")
    client.force_login(user)
    html = client.get(reverse(CHANGELIST)).content.decode()
    assert 'value="retry_jobs"' in html
    assert 'value="revoke_jobs"' not in html and 'value="cancel_jobs"' not in html
    assert 'value="cancel_running_jobs"' not in html
    running = JobFactory.create(status="processing")
    queued = JobFactory.create()
    for action, job in [
        ("revoke_jobs", running),
        ("cancel_jobs", queued),
        ("cancel_running_jobs", running),
    ]:
        response = post_action(client, action, [job.pk])
        assert "No action selected." in messages_of(response)
        page = post_action(client, action, [job.pk], confirm=False)
        assert page.status_code == 302  # no confirmation page either
    assert status(running.pk) == "processing" and status(queued.pk) == "queued"
    assert Job.objects.get(pk=running.pk).cancel_requested_at is None
    failed = JobFactory.create(status="failed")
    response = post_action(client, "retry_jobs", [failed.pk])
    assert messages_of(response)[-1] == "1 retried"


# --- API clients --------------------------------------------------------------------------


def test_client_create_shows_the_token_once(client):
    client.force_login(make_staff("root", superuser=True))
    response = client.post(reverse("admin:jobs_client_add"), {"name": "billing"})
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    token = response.context["token"]
    assert token and token in response.content.decode()
    created = Client.objects.get(name="billing")
    assert created.token_hash == Client.hash_token(token) and created.is_active
    entry = LogEntry.objects.get(object_id=str(created.pk))
    assert entry.action_flag == 1  # ADDITION
    change = client.get(reverse("admin:jobs_client_change", args=[created.pk]))
    assert token not in change.content.decode()
    assert created.token_hash not in change.content.decode()


def test_client_deactivate_action(client):
    client.force_login(make_staff("root", superuser=True))
    a, b = ClientFactory.create(), ClientFactory.create(is_active=False)
    response = client.post(
        reverse("admin:jobs_client_changelist"),
        {"action": "deactivate_clients", "_selected_action": [a.pk, b.pk]},
        follow=True,
    )
    assert messages_of(response) == ["1 deactivated, 1 skipped: already inactive"]
    a.refresh_from_db()
    assert not a.is_active
    assert LogEntry.objects.filter(object_id=str(a.pk)).count() == 1
    assert client.get(reverse("admin:jobs_client_delete", args=[a.pk])).status_code == 403


# --- odd input and bounded counts -------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    [
        "q=%C2%B2",
        "q=a%00",
        "task=a%00",
        "queue=a%00",
        "q=%C2%B2&task=echo",
        "queue=%00",
        "status__exact=a%00",
        "client__id__exact=%00",
        "stuck=%00",
    ],
)
def test_odd_list_queries_are_answered_not_500(client, alice, query):
    """'²'.isdigit() is True but int('²') fails; PostgreSQL text cannot hold NUL."""
    job = JobFactory.create(status="failed", task="echo", queue="default")
    response = client.get(reverse(CHANGELIST) + "?" + query, follow=True)
    assert response.status_code == 200
    if "%00" in query:  # an invalid lookup: Django's usual answer, the "?e=1" list
        assert response.redirect_chain[-1][0].endswith("?e=1")
    else:
        assert job.pk not in [j.pk for j in response.context["cl"].result_list]


def test_select_across_counts_are_capped(client, alice, monkeypatch):
    """D15: the confirmation and the action count at most the cap, never the whole set."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    monkeypatch.setattr(JobAdmin, "action_count_cap", 3)
    failed = [JobFactory.create(status="failed").pk for _ in range(5)]
    JobFactory.create(status="done")
    with CaptureQueriesContext(connection) as confirm:
        page = post_action(client, "retry_jobs", failed[:1], confirm=False, select_across=True)
    html = page.content.decode()
    assert 'id="selected-count">about ' in html and 'id="eligible-count">about ' in html
    assert "skipped-count" not in html
    with CaptureQueriesContext(connection) as act:
        response = post_action(client, "retry_jobs", failed[:1], select_across=True)
    assert messages_of(response) == ["5 retried (over 3 selected: the skipped are not counted)"]
    queries = confirm.captured_queries + act.captured_queries
    counts = [q["sql"] for q in queries if "COUNT(" in q["sql"]]
    assert all(" LIMIT " in sql for sql in counts), counts  # never an unbounded count
    assert sum(" LIMIT 4)" in sql for sql in counts) == 3, counts  # selected, eligible; action
