"""POST/GET/PATCH/DELETE /api/v1/schedules/: per client, every refusal a 400 that
writes nothing, and GET /api/v1/jobs/?schedule=<id>."""

from __future__ import annotations

import json

import pytest

from jobs.models import Schedule, SchedulerRun
from jobs.schedules.scheduler import Scheduler
from tests.factories import raw

URL = "/api/v1/schedules/"
BODY = {"name": "nightly", "cron": "0 3 * * *", "timezone": "Europe/Berlin", "task": "echo",
        "payload": {"report": "daily"}}  # fmt: skip


def post(api, body):
    return api.post(URL, data=json.dumps(body), content_type="application/json")


def patch(api, schedule_id, body):
    return api.patch(f"{URL}{schedule_id}/", data=json.dumps(body), content_type="application/json")


@pytest.mark.django_db
def test_create_read_list_patch_delete(api, me):
    r = post(api, BODY)
    assert r.status_code == 201, r.content
    s = r.json()
    assert r["Location"] == f"{URL}{s['id']}/"
    assert {k: s[k] for k in ("name", "cron", "interval_seconds", "timezone", "task")} == {
        "name": "nightly", "cron": "0 3 * * *", "interval_seconds": None,
        "timezone": "Europe/Berlin", "task": "echo",
    }  # fmt: skip
    assert (s["enabled"], s["catch_up"], s["overlap"], s["queue"]) == (
        True, "skip", "allow", "default"
    )  # fmt: skip
    assert s["next_fire_at"] is not None and s["last_fire_at"] is None
    assert Schedule.objects.get(pk=s["id"]).client == me
    assert api.get(f"{URL}{s['id']}/").json() == s
    listed = api.get(URL).json()
    assert [x["id"] for x in listed["results"]] == [s["id"]]
    r = patch(api, s["id"], {"interval_seconds": 60, "cron": None, "enabled": False})
    assert r.status_code == 200, r.content
    assert (r.json()["interval_seconds"], r.json()["cron"], r.json()["enabled"]) == (
        60, None, False
    )  # fmt: skip
    r = api.delete(f"{URL}{s['id']}/")
    assert r.status_code == 204
    assert not Schedule.objects.exists()
    assert api.get(f"{URL}{s['id']}/").status_code == 404


def counts() -> tuple[int, int]:
    return Schedule.objects.count(), SchedulerRun.objects.count()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"cron": "61 * * * *"}, "cron"),
        ({"cron": "every day"}, "cron"),
        ({"cron": None, "interval_seconds": 0}, "interval_seconds"),
        ({"cron": None, "interval_seconds": 0.5}, "interval_seconds"),
        ({"cron": None}, "cron"),
        ({"interval_seconds": 5}, "interval_seconds"),
        ({"timezone": "Europe/Atlantis"}, "timezone"),
        ({"task": "no-such-task"}, "task"),
        ({"payload": None}, "payload"),
        ({"payload": {"bad": "nul\u0000"}}, "payload"),
        ({"task": "sleep", "payload": {"seconds": "long"}}, "payload"),
        ({"queue": "nope"}, "queue"),
        ({"priority": 1000}, "priority"),
        ({"catch_up": "most"}, "catch_up"),
        ({"overlap": "sometimes"}, "overlap"),
        ({"enabled": "yes"}, "enabled"),
        ({"name": ""}, "name"),
        ({"colour": "red"}, "colour"),
    ],
    ids=["cron-range", "cron-words", "interval-zero", "interval-fraction", "no-timing",
         "both-timings", "zone", "task", "payload-null", "payload-nul", "payload-invalid",
         "queue", "priority", "catch-up", "overlap", "enabled", "name", "unknown-field"],
)  # fmt: skip
def test_every_refusal_is_400_and_writes_nothing(api, change, field):
    body = {k: v for k, v in {**BODY, **change}.items() if v is not None or k == "payload"}
    if change.get("cron", "") is None:
        body.pop("cron", None)
    before = counts()
    r = post(api, body)
    assert r.status_code == 400, r.content
    assert field in r.json()["errors"], r.json()
    assert counts() == before


@pytest.mark.django_db
def test_a_refused_patch_changes_nothing(api):
    s = post(api, BODY).json()
    r = patch(api, s["id"], {"cron": "nope", "name": "renamed"})
    assert r.status_code == 400
    assert api.get(f"{URL}{s['id']}/").json() == s


@pytest.mark.django_db
def test_a_name_is_unique_per_client(api, other):
    assert post(api, BODY).status_code == 201
    r = post(api, BODY)
    assert r.status_code == 400 and r.json()["code"] == "name_taken"
    _, bob = other
    assert post(bob, BODY).status_code == 201


@pytest.mark.django_db
def test_another_clients_schedule_is_404(api, other):
    s = post(api, BODY).json()
    _, bob = other
    assert bob.get(f"{URL}{s['id']}/").status_code == 404
    assert patch(bob, s["id"], {"enabled": False}).status_code == 404
    assert bob.delete(f"{URL}{s['id']}/").status_code == 404
    assert bob.get(URL).json()["results"] == []
    assert Schedule.objects.get(pk=s["id"]).enabled is True


@pytest.mark.django_db
def test_jobs_list_filters_by_schedule(api, other):
    s = post(api, {**BODY, "cron": None, "interval_seconds": 1} | {"cron": None}).json()
    raw("UPDATE jobs_schedule SET next_fire_at = now() WHERE id = %s", [s["id"]])
    Scheduler().tick()
    api.post("/api/v1/jobs/", data=json.dumps({"task": "echo", "payload": {}}),
             content_type="application/json")  # fmt: skip
    r = api.get("/api/v1/jobs/", {"schedule": s["id"]})
    assert r.status_code == 200
    (job,) = r.json()["results"]
    assert job["schedule"] == s["id"] and job["fire_time"] is not None
    _, bob = other
    assert bob.get("/api/v1/jobs/", {"schedule": s["id"]}).json()["results"] == []
    assert api.get("/api/v1/jobs/", {"schedule": "x"}).status_code == 400
