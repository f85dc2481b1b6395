"""POST /api/v1/jobs/: accepted submissions, and every refusal leaves nothing behind."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import REGISTRY

from jobs.transport import get_transport
from tests.api.conftest import counts

URL = "/api/v1/jobs/"

JOB_FIELDS = {
    "id",
    "task",
    "queue",
    "priority",
    "status",
    "payload",
    "result",
    "error",
    "retry_count",
    "max_retries",
    "timeout",
    "lease_version",
    "idempotency_key",
    "run_at",
    "created_at",
    "updated_at",
    "finished_at",
    "progress",
    "cancel_requested_at",
    "cancel_too_late",
    "unique_key",
    "concurrency_key",
    "sequence_key",
    "batch",
    "schedule",
    "fire_time",
    "duplicate",
    "debounced",
    "skipped",
    "wait_reason",
    "chain_id",
    "run_number",
    "previous_run_ids",
    "next_run_id",
}


def post_json(api, body, **extra):
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return api.post(URL, data=data, content_type="application/json", **extra)


def redis_ids(queue: str = "default") -> list[int]:
    t = get_transport()
    return [int(x) for x in t._client.lrange(t.key(queue), 0, -1)]


@pytest.mark.django_db
def test_submit_echo_creates_queued_job_and_signals_after_commit(
    api, me, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        r = post_json(api, {"task": "echo", "payload": {"hello": "world"}})
    assert r.status_code == 201, r.content
    body = r.json()
    assert set(body) == JOB_FIELDS
    assert body["task"] == "echo"
    assert body["payload"] == {"hello": "world"}
    assert body["status"] == "queued"
    assert body["queue"] == "default"
    assert body["priority"] == 0
    assert body["max_retries"] == 3
    assert body["retry_count"] == 0 and body["lease_version"] == 0
    assert body["result"] is None and body["error"] is None and body["finished_at"] is None
    assert r["Location"] == f"/api/v1/jobs/{body['id']}/"
    assert len(callbacks) == 2  # on commit: count the submission, push its id
    assert redis_ids() == [body["id"]]
    job = me.jobs.get()
    assert job.pk == body["id"] and job.updated_by == "client:alice"


@pytest.mark.django_db
def test_submit_with_all_fields(api, django_capture_on_commit_callbacks):
    run_at = datetime.now(UTC) + timedelta(hours=1)
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        r = post_json(
            api,
            {
                "task": "sleep",
                "payload": {"seconds": 1},
                "queue": "reports",
                "priority": 100,
                "run_at": run_at.isoformat(),
                "max_retries": 0,
            },
        )
    assert r.status_code == 201, r.content
    body = r.json()
    assert (body["queue"], body["priority"], body["max_retries"]) == ("reports", 100, 0)
    assert datetime.fromisoformat(body["run_at"]) == run_at
    # A job scheduled for later is not pushed now (D4): polling and the reaper find it.
    assert len(callbacks) == 1  # the submission's count only
    assert redis_ids("reports") == []


@pytest.mark.django_db
def test_payload_at_the_limit_is_accepted(api, settings):
    settings.JOBS_MAX_PAYLOAD_BYTES = 1000
    payload = {"s": "é" * 10}
    overhead = len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode())
    payload["s"] += "x" * (1000 - overhead)
    assert len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()) == 1000
    assert post_json(api, {"task": "echo", "payload": payload}).status_code == 201
    payload["s"] += "x"
    r = post_json(api, {"task": "echo", "payload": payload})
    assert r.status_code == 413
    assert r.json()["code"] == "payload_too_large"


def _nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


BAD_REQUESTS = [
    # (name, raw body or object, extra headers/kwargs, status, code)
    ("malformed json", '{"task": "echo", "payload": ', {}, 400, "malformed_json"),
    ("not json at all", "task=echo", {}, 400, "malformed_json"),
    ("nan is not json", '{"task": "echo", "payload": NaN}', {}, 400, "malformed_json"),
    ("hostile nesting", "[" * 100_000 + "]" * 100_000, {}, 400, "malformed_json"),
    ("body is a list", [{"task": "echo", "payload": {}}], {}, 400, "invalid"),
    ("empty body", "", {}, 400, "required"),
    ("unknown task", {"task": "no-such-task", "payload": {}}, {}, 400, "unknown_task"),
    ("task missing", {"payload": {}}, {}, 400, "required"),
    ("payload missing", {"task": "echo"}, {}, 400, "required"),
    ("payload null", {"task": "echo", "payload": None}, {}, 400, "null"),
    ("payload with NUL", {"task": "echo", "payload": {"a": "x\u0000y"}}, {}, 400,
     "invalid_payload"),
    ("payload too deep", {"task": "echo", "payload": _nested(150)}, {}, 400, "invalid_payload"),
    ("payload refused by task", {"task": "sleep", "payload": {"seconds": -1}}, {}, 400,
     "invalid_payload"),
    ("priority too high", {"task": "echo", "payload": {}, "priority": 101}, {}, 400,
     "invalid_priority"),
    ("priority too low", {"task": "echo", "payload": {}, "priority": -101}, {}, 400,
     "invalid_priority"),
    ("priority not a number", {"task": "echo", "payload": {}, "priority": "high"}, {}, 400,
     "invalid_priority"),
    ("priority boolean", {"task": "echo", "payload": {}, "priority": True}, {}, 400,
     "invalid_priority"),
    ("run_at not a timestamp", {"task": "echo", "payload": {}, "run_at": "tomorrow"}, {}, 400,
     "invalid_run_at"),
    ("run_at a number", {"task": "echo", "payload": {}, "run_at": 1700000000}, {}, 400,
     "invalid_run_at"),
    ("max_retries too high", {"task": "echo", "payload": {}, "max_retries": 101}, {}, 400,
     "invalid_max_retries"),
    ("max_retries negative", {"task": "echo", "payload": {}, "max_retries": -1}, {}, 400,
     "invalid_max_retries"),
    ("bad queue name", {"task": "echo", "payload": {}, "queue": "no spaces!"}, {}, 400,
     "invalid_queue"),
    ("unknown field", {"task": "echo", "payload": {}, "colour": "red"}, {}, 400, "unknown_field"),
    ("bad idempotency key", {"task": "echo", "payload": {}},
     {"HTTP_IDEMPOTENCY_KEY": "has spaces"}, 400, "invalid_idempotency_key"),
    ("too long idempotency key", {"task": "echo", "payload": {}},
     {"HTTP_IDEMPOTENCY_KEY": "k" * 201}, 400, "invalid_idempotency_key"),
]  # fmt: skip


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body,extra,status,code", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_request_is_refused_and_writes_nothing(
    api, body, extra, status, code, django_capture_on_commit_callbacks
):
    before = counts()
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        r = post_json(api, body, **extra)
    assert r.status_code == status, r.content
    err = r.json()
    assert err["code"] == code
    assert isinstance(err["detail"], str) and err["detail"]
    assert counts() == before
    assert callbacks == []
    assert redis_ids() == []


@pytest.mark.django_db
def test_field_errors_name_the_field(api):
    r = post_json(api, {"task": "echo", "payload": {}, "priority": 500, "colour": 1})
    assert r.status_code == 400
    err = r.json()
    assert err["code"] == "invalid"  # two different rules broken
    assert err["errors"]["priority"][0]["code"] == "invalid_priority"
    assert err["errors"]["colour"][0]["code"] == "unknown_field"


@pytest.mark.django_db
def test_payload_over_limit_is_413_and_writes_nothing(api, settings):
    settings.JOBS_MAX_PAYLOAD_BYTES = 1024
    before = counts()
    r = post_json(api, {"task": "echo", "payload": {"blob": "x" * 2000}})
    assert r.status_code == 413
    assert r.json()["code"] == "payload_too_large"
    assert r.json()["errors"]["payload"][0]["code"] == "payload_too_large"
    assert counts() == before


@pytest.mark.django_db
def test_far_too_large_body_is_refused_before_it_is_read(api, settings):
    """Content-Length past the bound: 413 without parsing (the body here is not even JSON)."""
    from jobs.api.parsers import max_body_bytes

    settings.JOBS_MAX_PAYLOAD_BYTES = 1024
    before = counts()
    r = post_json(api, b"x" * (max_body_bytes() + 1))
    assert r.status_code == 413
    assert r.json()["code"] == "request_too_large"
    assert counts() == before


@pytest.mark.django_db
def test_wrong_content_type_is_415(api):
    before = counts()
    r = api.post(URL, data="task=echo", content_type="text/plain")
    assert r.status_code == 415
    assert r.json()["code"] == "unsupported_media_type"
    assert counts() == before


@pytest.mark.django_db
def test_naive_run_at_is_read_as_utc(api):
    r = post_json(api, {"task": "echo", "payload": {}, "run_at": "2031-01-02T03:04:05"})
    assert r.status_code == 201, r.content
    assert datetime.fromisoformat(r.json()["run_at"]) == datetime(2031, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.mark.django_db
def test_refusals_are_counted_by_code(api):
    def sample():
        return (
            REGISTRY.get_sample_value(
                "jobs_submissions_rejected_total", {"queue": "default", "code": "unknown_task"}
            )
            or 0
        )

    before = sample()
    post_json(api, {"task": "nope", "payload": {}})
    assert sample() == before + 1


def test_parser_never_reads_past_its_bound(settings):
    """Without a usable Content-Length the parser still stops at the bound."""
    import io

    from jobs.api.errors import RequestTooLarge
    from jobs.api.parsers import BoundedJSONParser, max_body_bytes

    settings.JOBS_MAX_PAYLOAD_BYTES = 100
    limit = max_body_bytes()
    stream = io.BytesIO(b"[" + b" " * limit + b"]")
    with pytest.raises(RequestTooLarge):
        BoundedJSONParser().parse(stream, "application/json", {})
    assert stream.tell() == limit + 1  # read one byte past the bound, no more
    ok = BoundedJSONParser().parse(io.BytesIO(b'{"a": 1}'), "application/json", {})
    assert ok == {"a": 1}
