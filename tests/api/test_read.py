"""Reading, listing, cancelling and the history of a client's own jobs — and only its own."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from jobs.models import Job
from tests.api.conftest import counts
from tests.factories import JobFactory, raw


def make(client, status="queued", **kw) -> Job:
    return JobFactory.create(status=status, client_id=client.pk, **kw)


@pytest.mark.django_db
def test_retrieve_own_job(api, me):
    job = make(me, "done", payload={"n": 1})
    r = api.get(f"/api/v1/jobs/{job.pk}/")
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == job.pk
    assert body["status"] == "done"
    assert body["result"] == {"ok": True}
    assert body["payload"] == {"n": 1}
    assert body["lease_version"] == 1
    assert body["finished_at"] is not None
    assert "owned_by" not in body and "client" not in body


@pytest.mark.django_db
def test_unknown_job_is_404(api):
    r = api.get("/api/v1/jobs/999999999/")
    assert r.status_code == 404
    assert r.json()["code"] == "not_found"


@pytest.mark.django_db
def test_another_clients_job_is_invisible_everywhere(api, me, other):
    bob, bob_api = other
    theirs = make(bob, "queued")
    mine = make(me, "queued")
    before = counts()

    assert api.get(f"/api/v1/jobs/{theirs.pk}/").status_code == 404
    assert api.get(f"/api/v1/jobs/{theirs.pk}/history/").status_code == 404
    r = api.post(f"/api/v1/jobs/{theirs.pk}/cancel/")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    listed = api.get("/api/v1/jobs/").json()["results"]
    assert [j["id"] for j in listed] == [mine.pk]

    # Their job is untouched; they still see it as theirs.
    assert counts() == before
    assert Job.objects.get(pk=theirs.pk).status == "queued"
    assert bob_api.get(f"/api/v1/jobs/{theirs.pk}/").status_code == 200
    assert bob_api.get(f"/api/v1/jobs/{mine.pk}/").status_code == 404


@pytest.mark.django_db
def test_list_filters(api, me):
    done = make(me, "done", task="echo")
    failed = make(me, "failed", task="fail")
    queued = make(me, "queued", task="echo", queue="reports")
    parked = make(me, "enqueue_failed", task="echo")
    old = make(me, "queued", task="echo")
    raw(
        "UPDATE jobs_job SET created_at = %s WHERE id = %s",
        [datetime(2020, 1, 1, tzinfo=UTC), old.pk],
    )

    def ids(query: str) -> set[int]:
        r = api.get(f"/api/v1/jobs/?{query}")
        assert r.status_code == 200, r.content
        return {j["id"] for j in r.json()["results"]}

    assert ids("") == {done.pk, failed.pk, queued.pk, parked.pk, old.pk}
    assert ids("status=done") == {done.pk}
    assert ids("status=queued&status=enqueue_failed") == {queued.pk, parked.pk, old.pk}
    assert ids("task=fail") == {failed.pk}
    assert ids("queue=reports") == {queued.pk}
    assert ids("task=echo&status=queued&queue=default") == {old.pk}
    assert ids("created_before=2021-01-01T00:00:00Z") == {old.pk}
    assert ids("created_after=2021-01-01T00:00:00Z") == {done.pk, failed.pk, queued.pk, parked.pk}
    later = (datetime.now(UTC) + timedelta(days=1)).isoformat().replace("+00:00", "Z")
    assert ids(f"created_after={later}") == set()


@pytest.mark.django_db
@pytest.mark.parametrize("query", ["status=running", "created_after=yesterday"])
def test_bad_filter_is_400(api, query):
    r = api.get(f"/api/v1/jobs/?{query}")
    assert r.status_code == 400
    assert r.json()["code"] in {"invalid_choice", "invalid"}


@pytest.mark.django_db
def test_cursor_pagination_walks_every_job_once_newest_first(api, me):
    jobs = [make(me) for _ in range(7)]
    # Distinct creation times except for a tie, which the cursor must also get right.
    base = datetime(2030, 1, 1, tzinfo=UTC)
    for i, job in enumerate(jobs):
        at = base + timedelta(seconds=min(i, 5))
        raw("UPDATE jobs_job SET created_at = %s WHERE id = %s", [at, job.pk])

    seen: list[int] = []
    url = "/api/v1/jobs/?page_size=3"
    pages = 0
    while url:
        r = api.get(url)
        assert r.status_code == 200
        page = r.json()
        assert len(page["results"]) <= 3
        seen.extend(j["id"] for j in page["results"])
        url = page["next"]
        pages += 1
    assert pages == 3
    assert seen == [j.pk for j in reversed(jobs)]


@pytest.mark.django_db
@pytest.mark.parametrize("status", ["queued", "enqueue_failed"])
def test_cancel_a_job_not_started(api, me, status):
    job = make(me, status)
    r = api.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["status"] == "failed"
    assert body["error"] == "cancelled"
    assert body["finished_at"] is not None
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.error, row.updated_by) == ("failed", "cancelled", "client:alice")


@pytest.mark.django_db
@pytest.mark.parametrize("status", ["done", "failed"])
def test_cancel_of_a_finished_job_is_409_with_current_status(api, me, status):
    job = make(me, status)
    before = Job.objects.get(pk=job.pk)
    r = api.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert r.status_code == 409
    err = r.json()
    assert err["code"] == "not_cancellable"
    assert err["status"] == status
    after = Job.objects.get(pk=job.pk)
    assert (after.status, after.error, after.lease_version) == (
        before.status,
        before.error,
        before.lease_version,
    )


@pytest.mark.django_db
def test_cancel_twice_is_409(api, me):
    job = make(me)
    assert api.post(f"/api/v1/jobs/{job.pk}/cancel/").status_code == 200
    r = api.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert r.status_code == 409 and r.json()["status"] == "failed"


@pytest.mark.django_db
def test_history_of_a_finished_job(api, me):
    job = make(me, "done", worker="w-1")
    r = api.get(f"/api/v1/jobs/{job.pk}/history/")
    assert r.status_code == 200
    assert r.json()["next"] is None and r.json()["previous"] is None
    events = r.json()["results"]
    assert [(e["from_status"], e["to_status"]) for e in events] == [
        (None, "queued"),
        ("queued", "processing"),
        ("processing", "done"),
    ]
    # Roles, not identities: no host, pid or worker id reaches a client.
    assert [e["role"] for e in events] == ["api", "worker", "worker"]
    assert "w-1" not in r.content.decode()
    assert [e["lease_version"] for e in events] == [0, 1, 1]
    assert all(e["kind"] == "transition" and e["at"] for e in events)
    assert set(events[0]) == {
        "id",
        "kind",
        "at",
        "role",
        "from_status",
        "to_status",
        "lease_version",
        "retry_count",
        "error",
        "error_class",
        "error_traceback",
    }


@pytest.mark.django_db
def test_history_records_a_cancel_by_its_client(api, me):
    job = make(me)
    api.post(f"/api/v1/jobs/{job.pk}/cancel/")
    r = api.get(f"/api/v1/jobs/{job.pk}/history/")
    last = r.json()["results"][-1]
    assert (last["from_status"], last["to_status"], last["role"], last["error"]) == (
        "queued",
        "failed",
        "client",
        "cancelled",
    )
    assert "alice" not in r.content.decode()


@pytest.mark.django_db
def test_wrong_method_is_405(api, me):
    job = make(me)
    r = api.delete(f"/api/v1/jobs/{job.pk}/")
    assert r.status_code == 405
    assert r.json()["code"] == "method_not_allowed"
    assert Job.objects.filter(pk=job.pk).exists()


@pytest.mark.django_db
def test_history_pages_oldest_first_with_a_cursor(api, me):
    job = make(me, "done", worker="w-1")
    first = api.get(f"/api/v1/jobs/{job.pk}/history/?page_size=2")
    assert first.status_code == 200
    page = first.json()
    assert [e["to_status"] for e in page["results"]] == ["queued", "processing"]
    assert page["previous"] is None and page["next"]
    second = api.get(page["next"]).json()
    assert [e["to_status"] for e in second["results"]] == ["done"]
    assert second["next"] is None
    back = api.get(second["previous"]).json()
    assert [e["to_status"] for e in back["results"]] == ["queued", "processing"]


@pytest.mark.django_db
@pytest.mark.parametrize("query", ["status=done", "status=queued", "task=echo", "queue=x"])
def test_history_refuses_the_list_filters(api, me, query):
    """Once applied to the job lookup: ?status=done on a done job answered 404."""
    job = make(me, "done", worker="w-1")
    r = api.get(f"/api/v1/jobs/{job.pk}/history/?{query}")
    assert r.status_code == 400, r.content
    assert r.json()["code"] == "unknown_parameter"
    assert list(r.json()["errors"]) == [query.split("=")[0]]


@pytest.mark.django_db
@pytest.mark.parametrize("cursor", ["garbage", "cD1hYmM=", "cD0xZTk5OTk5OTk5OTk5OTk5OTk5OTk="])
def test_history_refuses_a_cursor_it_did_not_issue(api, me, cursor):
    job = make(me, "done", worker="w-1")
    r = api.get(f"/api/v1/jobs/{job.pk}/history/?cursor={cursor}")
    assert r.status_code == 400 and r.json()["code"] == "invalid_cursor"


@pytest.mark.django_db
def test_history_shows_staff_as_a_role(api, me):
    from jobs import services

    job = make(me, "failed")
    assert services.staff_retry([job.pk], actor="staff:bob") == [job.pk]
    r = api.get(f"/api/v1/jobs/{job.pk}/history/")
    assert r.json()["results"][-1]["role"] == "staff"
    assert "bob" not in r.content.decode()


@pytest.mark.parametrize(
    "actor,role",
    [
        ("worker:host-1:4242:ab12", "worker"),
        ("reaper", "reaper"),
        ("reaper:host-1:77", "reaper"),
        ("staff:bob", "staff"),
        ("client:alice", "client"),
        ("app", "api"),
        ("", "api"),
        (None, "api"),
        ("api:x", "api"),
        ("someone-else:x", "api"),
    ],
)
def test_actor_role(actor, role):
    from jobs.lifecycle import actor_role

    assert actor_role(actor) == role
