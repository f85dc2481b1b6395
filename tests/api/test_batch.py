"""POST /api/v1/jobs/batch/: up to 1000 jobs in one request, all or nothing, with
per-job idempotency keys; against the real PostgreSQL and Redis."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from jobs import services
from jobs.models import Job, JobEvent
from jobs.transport import get_transport
from tests.api.conftest import authed, counts, new_client

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/api/v1/jobs/batch/"


def post(api, body, **extra):
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return api.post(URL, data=data, content_type="application/json", **extra)


def redis_ids(queue: str = "default") -> list[int]:
    t = get_transport()
    return [int(x) for x in t._client.lrange(t.key(queue), 0, -1)]


def test_batch_creates_every_job_in_order_and_signals_them_after_commit(api, me):
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    jobs = [
        {"task": "echo", "payload": {"n": 0}},
        {"task": "sleep", "payload": {"seconds": 1}, "queue": "slow", "priority": 7},
        {"task": "echo", "payload": [1, 2], "max_retries": 0, "idempotency_key": "k-2"},
        {"task": "echo", "payload": {"n": 3}, "run_at": later},
    ]
    r = post(api, {"jobs": jobs})
    assert r.status_code == 201, r.content
    out = r.json()["jobs"]
    assert [j["created"] for j in out] == [True] * 4
    assert [j["task"] for j in out] == ["echo", "sleep", "echo", "echo"]
    assert out[2]["idempotency_key"] == "k-2" and out[0]["idempotency_key"] is None
    rows = {j.pk: j for j in Job.objects.filter(pk__in=[j["id"] for j in out])}
    assert len(rows) == 4
    for sent, got in zip(jobs, out, strict=True):
        job = rows[got["id"]]
        assert (job.task, job.payload, job.status) == (sent["task"], sent["payload"], "queued")
        assert job.client_id == me.pk and job.updated_by == f"client:{me.name}"
    assert rows[out[1]["id"]].queue == "slow" and rows[out[1]["id"]].priority == 7
    assert rows[out[2]["id"]].max_retries == 0
    # Due jobs are signalled once each; the scheduled one waits for its run_at.
    assert redis_ids() == [out[0]["id"], out[2]["id"]]
    assert redis_ids("slow") == [out[1]["id"]]
    assert JobEvent.objects.filter(job_id__in=rows, to_status="queued").count() == 4


def test_one_bad_job_refuses_the_whole_batch_with_an_error_per_job(api):
    before = counts()
    r = post(
        api,
        {
            "jobs": [
                {"task": "echo", "payload": {}},
                {"task": "no-such-task", "payload": {}},
                {"task": "echo", "payload": {}, "priority": 1000},
                {"task": "echo"},
                {"task": "echo", "payload": {}, "colour": "red"},
                {"task": "sleep", "payload": {"seconds": -1}},
                {"task": "echo", "payload": {}, "run_at": "tomorrow"},
                {"task": "echo", "payload": {}, "idempotency_key": "has space"},
                "not an object",
            ]
        },
    )
    assert r.status_code == 400, r.content
    body = r.json()
    assert body["code"] == "invalid_batch"
    assert "nothing was written" in body["detail"] and body["detail"].startswith("8 of 9")
    codes = {k: [e["code"] for e in v] for k, v in body["errors"].items()}
    assert codes == {
        "jobs.1.task": ["unknown_task"],
        "jobs.2.priority": ["invalid_priority"],
        "jobs.3.payload": ["required"],
        "jobs.4.colour": ["unknown_field"],
        "jobs.5.payload": ["invalid_payload"],
        "jobs.6.run_at": ["invalid_run_at"],
        "jobs.7.idempotency_key": ["invalid_idempotency_key"],
        "jobs.8": ["invalid"],
    }
    assert counts() == before
    assert redis_ids() == []


@pytest.mark.parametrize(
    "body",
    [
        {"jobs": []},
        {"jobs": [{"task": "echo", "payload": {}}] * 1001},
        {"job": [{"task": "echo", "payload": {}}]},
        {"jobs": {"task": "echo"}},
        [{"task": "echo", "payload": {}}],
        {"jobs": [{"task": "echo", "payload": {}}], "extra": 1},
    ],
    ids=["empty", "1001", "misspelt", "not-a-list", "bare-list", "unknown-top-field"],
)
def test_malformed_batches_are_refused_and_write_nothing(api, body):
    before = counts()
    r = post(api, body)
    assert r.status_code == 400, r.content
    assert r.json()["code"] in {"invalid_batch", "required", "unknown_field"}
    assert counts() == before


def test_malformed_json_and_unauthenticated_requests(api, anon):
    assert post(api, "{not json").json()["code"] == "malformed_json"
    r = post(anon, {"jobs": [{"task": "echo", "payload": {}}]})
    assert r.status_code == 401
    assert counts() == (0, 0)


def test_per_job_idempotency_keys_replay_and_conflict(api):
    first = post(
        api,
        {
            "jobs": [
                {"task": "echo", "payload": {"a": 1}, "idempotency_key": "a"},
                {"task": "echo", "payload": {"b": 1}, "idempotency_key": "b"},
            ]
        },
    )
    assert first.status_code == 201
    ids = [j["id"] for j in first.json()["jobs"]]
    before = counts()

    replay = post(
        api,
        {
            "jobs": [
                {"task": "echo", "payload": {"b": 1}, "idempotency_key": "b"},
                {"task": "echo", "payload": {"a": 1}, "idempotency_key": "a"},
            ]
        },
    )
    assert replay.status_code == 200, replay.content
    assert [(j["id"], j["created"]) for j in replay.json()["jobs"]] == [
        (ids[1], False),
        (ids[0], False),
    ]
    assert counts() == before

    mixed = post(
        api,
        {
            "jobs": [
                {"task": "echo", "payload": {"a": 1}, "idempotency_key": "a"},
                {"task": "echo", "payload": {"c": 1}, "idempotency_key": "c"},
            ]
        },
    )
    assert mixed.status_code == 201
    assert [j["created"] for j in mixed.json()["jobs"]] == [False, True]
    before = counts()

    conflict = post(
        api,
        {
            "jobs": [
                {"task": "echo", "payload": {"d": 1}, "idempotency_key": "d"},
                {"task": "echo", "payload": {"a": 2}, "idempotency_key": "a"},
            ]
        },
    )
    assert conflict.status_code == 409, conflict.content
    body = conflict.json()
    assert body["code"] == "idempotency_conflict" and body["job_ids"] == {"1": ids[0]}
    assert list(body["errors"]) == ["jobs.1.idempotency_key"]
    assert counts() == before
    assert not Job.objects.filter(idempotency_key="d").exists()


def test_a_key_in_a_batch_and_the_single_endpoint_are_one_namespace(api):
    single = api.post(
        "/api/v1/jobs/",
        data=json.dumps({"task": "echo", "payload": {"x": 1}}),
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY="shared",
    )
    assert single.status_code == 201
    r = post(api, {"jobs": [{"task": "echo", "payload": {"x": 1}, "idempotency_key": "shared"}]})
    assert r.status_code == 200 and r.json()["jobs"][0]["id"] == single.json()["id"]


def test_keys_are_per_client(api):
    _, token = new_client("carol")
    body = {"jobs": [{"task": "echo", "payload": {}, "idempotency_key": "same"}]}
    a = post(api, body).json()["jobs"][0]
    b = post(authed(token), body).json()["jobs"][0]
    assert a["created"] and b["created"] and a["id"] != b["id"]


def test_backpressure_counts_the_whole_batch(api, settings):
    settings.JOBS_MAX_QUEUE_DEPTH = 4
    assert post(api, {"jobs": [{"task": "echo", "payload": {}}] * 3}).status_code == 201
    before = counts()
    r = post(api, {"jobs": [{"task": "echo", "payload": {}}] * 2})
    assert r.status_code == 429, r.content
    assert r.json()["code"] == "queue_full" and r["Retry-After"]
    assert counts() == before
    assert post(api, {"jobs": [{"task": "echo", "payload": {}}]}).status_code == 201


def test_redis_refusing_connections_parks_the_batch_durably(api, settings, closed_redis_url):
    settings.REDIS_URL = closed_redis_url
    r = post(api, {"jobs": [{"task": "echo", "payload": {"n": n}} for n in range(3)]})
    assert r.status_code == 201, r.content
    out = r.json()["jobs"]
    assert {j["status"] for j in out} == {"enqueue_failed"}
    assert set(
        Job.objects.filter(pk__in=[j["id"] for j in out]).values_list("status", flat=True)
    ) == {"enqueue_failed"}
    assert services.repair_enqueue_failed() == [j["id"] for j in out]


def test_replaying_a_keyed_batch_near_a_full_queue_is_answered(api, settings):
    """D24: a replay of jobs that exist is answered (200), not refused (429): only the
    jobs a batch would create count toward the depth check, as for a single job."""
    settings.JOBS_MAX_QUEUE_DEPTH = 4
    jobs = [{"task": "echo", "payload": {"n": n}, "idempotency_key": f"r-{n}"} for n in range(3)]
    first = post(api, {"jobs": jobs})
    assert first.status_code == 201
    assert post(api, {"jobs": [{"task": "echo", "payload": {}}]}).status_code == 201  # full now
    before = counts()
    replay = post(api, {"jobs": jobs})
    assert replay.status_code == 200, replay.content
    assert [j["id"] for j in replay.json()["jobs"]] == [j["id"] for j in first.json()["jobs"]]
    assert not any(j["created"] for j in replay.json()["jobs"])
    assert counts() == before
    # A key repeated within a batch creates one job: the replay of it counts once.
    twice = post(api, {"jobs": [jobs[0], jobs[0]]})
    assert twice.status_code == 200 and not any(j["created"] for j in twice.json()["jobs"])
    # A replay mixed with one new job: the new one still counts, and the queue is full.
    mixed = post(api, {"jobs": [*jobs, {"task": "echo", "payload": {}, "idempotency_key": "new"}]})
    assert mixed.status_code == 429 and mixed.json()["code"] == "queue_full"
    assert counts() == before
