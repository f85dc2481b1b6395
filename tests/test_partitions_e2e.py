"""Jobs through a real worker, moved to their cold partition by a real reaper (hot
window 0), then read back through the API (by id, listing, history) and the admin."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from jobs.models import Client, Job
from jobs.pgtypes import HOT
from tests.factories import raw
from tests.harness import wait_until

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
