"""Idempotency-Key (SPEC §9): same key + same request → the same job; another request → 409."""

from __future__ import annotations

import json

import pytest

from jobs.models import Job
from tests.api.conftest import authed, counts, new_client
from tests.race import race

URL = "/api/v1/jobs/"
BODY = {"task": "echo", "payload": {"n": 1}}


def post(api, body, key):
    return api.post(
        URL, data=json.dumps(body), content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )


@pytest.mark.django_db
def test_same_key_same_body_returns_the_same_job(api):
    first = post(api, BODY, "order-1")
    assert first.status_code == 201
    again = post(api, BODY, "order-1")
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["idempotency_key"] == "order-1"
    assert Job.objects.filter(idempotency_key="order-1").count() == 1


@pytest.mark.django_db
def test_replay_returns_the_job_as_it_is_now(api, me):
    first = post(api, BODY, "k").json()
    api.post(f"/api/v1/jobs/{first['id']}/cancel/")
    again = post(api, BODY, "k")
    assert again.status_code == 200
    assert again.json()["status"] == "failed"


@pytest.mark.django_db
def test_explicit_defaults_match_omitted_ones(api):
    first = post(api, BODY, "k")
    explicit = {**BODY, "queue": "default", "priority": 0, "max_retries": 3, "run_at": None}
    again = post(api, explicit, "k")
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "change",
    [
        {"payload": {"n": 2}},
        {"task": "sleep", "payload": {"seconds": 1}},
        {"queue": "other"},
        {"priority": 1},
        {"max_retries": 0},
        {"run_at": "2031-01-01T00:00:00Z"},
    ],
    ids=lambda c: ",".join(c),
)
def test_same_key_different_request_is_409_and_writes_nothing(api, change):
    first = post(api, BODY, "k").json()
    before = counts()
    r = post(api, {**BODY, **change}, "k")
    assert r.status_code == 409
    err = r.json()
    assert err["code"] == "idempotency_conflict"
    assert err["job_id"] == first["id"]
    assert counts() == before
    assert Job.objects.get(pk=first["id"]).payload == {"n": 1}


@pytest.mark.django_db
def test_keys_are_scoped_per_client(api, other):
    _, bob_api = other
    mine = post(api, BODY, "shared-key")
    theirs = post(bob_api, {**BODY, "payload": {"n": 99}}, "shared-key")
    assert mine.status_code == 201 and theirs.status_code == 201
    assert mine.json()["id"] != theirs.json()["id"]


@pytest.mark.django_db
def test_without_a_key_every_submission_is_new(api):
    a = api.post(URL, data=json.dumps(BODY), content_type="application/json")
    b = api.post(URL, data=json.dumps(BODY), content_type="application/json")
    assert a.status_code == b.status_code == 201
    assert a.json()["id"] != b.json()["id"]


@pytest.mark.django_db(transaction=True)
def test_twenty_concurrent_submissions_with_one_key_create_one_job():
    """Real connections, one per thread, released together: the unique constraint
    lets exactly one INSERT through; the other nineteen see its committed row."""
    client, token = new_client("racer")
    n = 20

    def submit(i: int, go) -> tuple[int, int]:
        api = authed(token)
        go()
        r = post(api, BODY, "the-one-key")
        return r.status_code, r.json()["id"]

    results = race(n, submit)
    statuses = sorted(code for code, _ in results)
    assert statuses == [200] * (n - 1) + [201]
    assert len({job_id for _, job_id in results}) == 1
    assert Job.objects.filter(client=client, idempotency_key="the-one-key").count() == 1
    assert Job.objects.count() == 1
