"""Jobs through a real worker, moved to their cold partition by a real reaper (hot
window 0), then read back through the API (by id, listing, history) and the admin."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from jobs import partitions, services
from jobs.models import Client, Job
from jobs.pgtypes import HOT
from tests.factories import JobFactory, raw
from tests.harness import database_url, interrupt_detach, wait_until

pytestmark = pytest.mark.slow


def test_moved_jobs_read_back_through_the_api_and_the_admin(stack, client):
    _, token = Client.create_with_token("cold")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    ids = []
    for payload in ({"task": "echo", "payload": {"n": 1}}, {"task": "fail", "max_retries": 0}):
        r = api.post("/api/v1/jobs/", {"payload": {}, **payload}, format="json")
        assert r.status_code == 201, r.content
        ids.append(r.json()["id"])
    stack.worker("--concurrency", "2")
    stack.reaper(JOBS_HOT_FINISHED_SECONDS="0", JOBS_REAPER_INTERVAL="0.2")

    def moved() -> bool:
        return all(j.period != HOT for j in Job.objects.filter(pk__in=ids)) and len(ids) == 2

    wait_until(moved, 30, message="both jobs moved to a cold partition")
    parts = {r[0] for r in raw("SELECT tableoid::regclass::text FROM jobs_job WHERE id = ANY(%s)",
                               [ids])}  # fmt: skip
    assert all(p.startswith("jobs_job_p") for p in parts), parts

    done, failed = (api.get(f"/api/v1/jobs/{i}/").json() for i in ids)
    assert (done["status"], done["result"]) == ("done", {"n": 1})
    assert failed["status"] == "failed"
    listed = api.get("/api/v1/jobs/").json()
    rows = listed["results"] if isinstance(listed, dict) else listed
    assert {r["id"] for r in rows} >= set(ids)
    history = api.get(f"/api/v1/jobs/{ids[0]}/history/").json()
    events = history["results"] if isinstance(history, dict) else history
    assert [e["to_status"] for e in events] == ["queued", "processing", "done"]

    staff = User.objects.create_superuser("ops", password="pw")
    client.force_login(staff)
    page = client.get(f"/admin/jobs/job/{ids[1]}/change/")
    assert page.status_code == 200 and b"failed" in page.content
    listing = client.get("/admin/jobs/job/")
    assert listing.status_code == 200


def _pending(table: str) -> bool:
    return raw(
        "SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass(%s)", [table]
    ) == [(True,)]


def _attached(table: str) -> bool:
    return raw(
        "SELECT NOT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass(%s)", [table]
    ) == [(True,)]


@pytest.fixture
def current_period(transactional_db):
    """The current period's partitions; one left detach pending by a failed test is put
    back, so the database stays whole for the tests after it."""
    partitions.ensure_ahead()
    start = partitions.period_start(partitions.datetime.now(partitions.UTC))
    yield start
    for parent, table, bound in raw(
        "SELECT inhparent::regclass::text, inhrelid::regclass::text, "
        "pg_get_expr(relpartbound, inhrelid) FROM pg_inherits "
        "JOIN pg_class ON pg_class.oid = inhrelid WHERE inhdetachpending"
    ):
        raw(f"ALTER TABLE {parent} DETACH PARTITION {table} FINALIZE")
        raw(f"ALTER TABLE {parent} ATTACH PARTITION {table} {bound}")


def test_a_reaper_attaches_again_a_job_partition_left_detach_pending(stack, current_period):
    """An interrupted DETACH … CONCURRENTLY of the current period's job partition: no row
    can be moved there (PostgreSQL routes none to it) and its cold jobs vanish from reads.
    A real reaper finds it, attaches it again and moves on; no sweep fails (D214)."""
    table = partitions.partition_name("jobs_job", current_period)
    cold = [JobFactory.create(status="done").pk for _ in range(2)]
    raw("UPDATE jobs_job SET period = %s WHERE id = ANY(%s)", [current_period, cold])
    interrupt_detach(database_url(), "jobs_job", table)
    assert _pending(table)
    assert raw("SELECT count(*) FROM jobs_job WHERE id = ANY(%s)", [cold]) == [(0,)]
    hot = [JobFactory.create(status="failed").pk for _ in range(3)]

    reaper = stack.reaper(JOBS_HOT_FINISHED_SECONDS="0", JOBS_REAPER_INTERVAL="0.2")

    def healed() -> bool:
        where = raw("SELECT tableoid::regclass::text FROM jobs_job WHERE id = ANY(%s)",
                    [cold + hot])  # fmt: skip
        return _attached(table) and [w for (w,) in where] == [table] * 5

    wait_until(healed, 60, message=f"{table} attached again and the finished jobs moved there")
    log = reaper.output()
    assert f"partition {table} of jobs_job is detach pending: attaching it again" in log
    assert "postgres unavailable" not in log and "sweep failed" not in log, log


def test_a_reaper_attaches_again_a_history_partition_left_detach_pending(stack, current_period):
    """The same for the partition that takes today's history (legacy until the period
    after the migration): until it is back no job can be written at all (its history
    row has nowhere to go)."""
    probe, _ = services.submit("echo", {}, actor="app")
    ((table,),) = raw(
        "SELECT DISTINCT tableoid::regclass::text FROM jobs_jobevent WHERE job_id = %s", [probe.pk]
    )
    interrupt_detach(database_url(), "jobs_jobevent", table)
    assert _pending(table)
    with pytest.raises(Exception, match="no partition of relation"):
        services.submit("echo", {}, actor="app")

    reaper = stack.reaper(JOBS_REAPER_INTERVAL="0.2")

    wait_until(lambda: _attached(table), 60, message=f"{table} attached again")
    job, _ = services.submit("echo", {}, actor="app")
    assert raw("SELECT tableoid::regclass::text FROM jobs_jobevent WHERE job_id = %s",
               [job.pk]) == [(table,)]  # fmt: skip
    assert "postgres unavailable" not in reaper.output()
