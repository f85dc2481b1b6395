"""Odd inputs are a clear 4xx in the API's error shape, never a 500 (each one below
answered 500 once)."""

from __future__ import annotations

import json

import pytest

from tests.api.conftest import counts

pytestmark = pytest.mark.django_db(transaction=True)

JOBS = "/api/v1/jobs/"
BATCH = "/api/v1/jobs/batch/"


def post_raw(api, url, text, content_type="application/json", **extra):
    return api.post(url, data=text.encode("utf-8"), content_type=content_type, **extra)


def assert_4xx(r, status=400, code=None):
    assert r.status_code == status, (r.status_code, r.content[:500])
    assert r["Content-Type"].startswith("application/json")
    body = r.json()
    assert set(body) >= {"detail", "code"}
    if code is not None:
        assert body["code"] == code, body


def test_lone_surrogate_in_a_single_payload_is_400(api):
    before = counts()
    r = post_raw(api, JOBS, '{"task": "echo", "payload": {"a": "\\ud800"}}')
    assert_4xx(r, code="invalid_payload")
    assert counts() == before


def test_lone_surrogate_in_a_payload_key_is_400(api):
    r = post_raw(api, JOBS, '{"task": "echo", "payload": {"\\udfff": 1}}')
    assert_4xx(r, code="invalid_payload")


def test_lone_surrogate_in_a_batch_payload_is_400(api):
    before = counts()
    r = post_raw(api, BATCH, '{"jobs": [{"task": "echo", "payload": ["\\ud800"]}]}')
    assert_4xx(r, code="invalid_batch")
    assert r.json()["errors"]["jobs.0.payload"][0]["code"] == "invalid_payload"
    assert counts() == before


@pytest.mark.parametrize(
    "url,text,code",
    [
        (JOBS, '{"task": "ec\\ud800ho", "payload": 1}', "unknown_task"),
        (JOBS, '{"task": "echo", "payload": 1, "\\udfff": 1}', "unknown_field"),
        (JOBS, '{"task": "echo", "payload": 1, "queue": "\\ud800"}', "invalid_queue"),
        (
            BATCH,
            '{"jobs": [{"task": "echo", "payload": 1, "idempotency_key": "\\ud800"}]}',
            "invalid_batch",
        ),
        (BATCH, '{"jobs": [{"task": "echo", "payload": 1, "\\ud800": 1}]}', "invalid_batch"),
        (BATCH, '{"jobs": [], "\\ud800": 1}', "unknown_field"),
    ],
)
def test_lone_surrogate_elsewhere_is_400(api, url, text, code):
    assert_4xx(post_raw(api, url, text), code=code)


@pytest.mark.parametrize(
    "run_at",
    [
        "2024-02-30T00:00:00",
        "2024-01-01T25:00:00",
        "0001-01-01T00:00:00+05:00",
        "9999-12-31T23:00:00-05:00",
    ],
)
def test_impossible_batch_run_at_is_400(api, run_at):
    before = counts()
    job = {"task": "echo", "payload": 1, "run_at": run_at}
    r = post_raw(api, BATCH, json.dumps({"jobs": [job]}))
    assert_4xx(r, code="invalid_batch")
    assert r.json()["errors"]["jobs.0.run_at"][0]["code"] == "invalid_run_at"
    assert counts() == before


@pytest.mark.parametrize("run_at", ["0001-01-01T00:00:00+05:00", "9999-12-31T23:00:00-05:00"])
def test_out_of_range_single_run_at_is_400(api, run_at):
    r = post_raw(api, JOBS, json.dumps({"task": "echo", "payload": 1, "run_at": run_at}))
    assert_4xx(r, code="invalid_run_at")


@pytest.mark.parametrize(
    "query",
    [
        "created_after=2024-02-30T00:00:00",
        "created_before=2024-01-01T25:00:00",
        "created_before=0001-01-01T00:00:00%2B05:00",
        "created_after=9999-12-31T23:00:00-05:00",
    ],
)
def test_odd_created_filters_are_400(api, query):
    r = api.get(f"{JOBS}?{query}")
    assert_4xx(r)
    assert set(r.json()["errors"]) <= {"created_after", "created_before"}


@pytest.mark.parametrize(
    "query,found",
    [
        ("created_after=2024-01-01T00:00:00-18:05", True),
        ("created_before=2024-01-01T00:00:00-22:03", False),
        ("created_after=0177-01-01T00:00:00-22:03", True),
        ("created_before=0177-01-01T00:00:00", False),
    ],
)
def test_offsets_postgres_refuses_and_far_years_are_answered_in_utc(api, query, found):
    """Offsets past PostgreSQL's ±15:59 are legal ISO 8601: the bound is sent in UTC."""
    job = api.post(JOBS, {"task": "echo", "payload": 1}, format="json").json()
    r = api.get(f"{JOBS}?{query}")
    assert r.status_code == 200, r.content
    assert [j["id"] for j in r.json()["results"]] == ([job["id"]] if found else [])


@pytest.mark.parametrize("cursor", ["garbage", "!!!", "cD0yMDI0", "bz0xJnA9eA==", "%00"])
def test_garbage_cursor_is_400(api, cursor):
    api.post(JOBS, {"task": "echo", "payload": 1}, format="json")
    r = api.get(f"{JOBS}?cursor={cursor}")
    assert_4xx(r, code="invalid_cursor")


def test_issued_cursors_still_page(api):
    ids = [api.post(JOBS, {"task": "echo", "payload": n}, format="json").json() for n in range(3)]
    ids = [j["id"] for j in ids]
    page = api.get(f"{JOBS}?page_size=2").json()
    seen = [j["id"] for j in page["results"]]
    page = api.get(page["next"]).json()
    seen += [j["id"] for j in page["results"]]
    assert seen == ids[::-1]
    assert api.get(page["previous"]).status_code == 200


@pytest.mark.parametrize("charset", ["hex", "base64", "rot13", "zlib", "no-such-codec"])
@pytest.mark.parametrize("url", [JOBS, BATCH])
def test_unusable_charset_is_415(api, url, charset):
    r = post_raw(api, url, '{"task": "echo", "payload": 1}', f"application/json; charset={charset}")
    assert_4xx(r, status=415, code="unsupported_media_type")


@pytest.mark.parametrize(
    "body",
    [
        {"task": "echo", "payload": 1, "queue": "default\n"},
        {"task": "echo", "payload": 1, "queue": "q" * 101},
    ],
)
def test_queue_with_trailing_newline_or_too_long_is_400(api, body):
    before = counts()
    r = post_raw(api, JOBS, json.dumps(body))
    assert_4xx(r, code="invalid_queue")
    r = post_raw(api, BATCH, json.dumps({"jobs": [body]}))
    assert_4xx(r, code="invalid_batch")
    assert r.json()["errors"]["jobs.0.queue"][0]["code"] == "invalid_queue"
    assert counts() == before


@pytest.mark.parametrize("key", ["k\n", "k" * 201])
def test_idempotency_key_with_trailing_newline_or_too_long_is_400(api, key):
    before = counts()
    job = {"task": "echo", "payload": 1, "idempotency_key": key}
    r = post_raw(api, BATCH, json.dumps({"jobs": [job]}))
    assert_4xx(r, code="invalid_batch")
    assert r.json()["errors"]["jobs.0.idempotency_key"][0]["code"] == "invalid_idempotency_key"
    assert counts() == before


def test_idempotency_header_with_trailing_newline_is_400(api):
    # A header cannot carry a raw newline over HTTP, but a WSGI client can send one.
    r = post_raw(api, JOBS, '{"task": "echo", "payload": 1}', HTTP_IDEMPOTENCY_KEY="k\n")
    assert_4xx(r, code="invalid_idempotency_key")


@pytest.mark.parametrize("url", [JOBS, BATCH])
def test_run_at_offset_postgres_refuses_is_stored_in_utc(api, url):
    """-18:05 is legal ISO 8601 but past PostgreSQL's ±15:59: normalised, not a DataError."""
    job = {"task": "echo", "payload": 1, "run_at": "2030-01-01T00:00:00-18:05"}
    r = post_raw(api, url, json.dumps(job if url == JOBS else {"jobs": [job]}))
    assert r.status_code == 201, r.content
    out = r.json() if url == JOBS else r.json()["jobs"][0]
    assert out["run_at"] == "2030-01-01T18:05:00Z"


@pytest.mark.parametrize(
    "query", ["task=a%00", "queue=a%00", "status=a%00", "task=%C2%B2", "page_size=%00"]
)
def test_nul_in_a_list_filter_is_answered(api, query):
    r = api.get(f"{JOBS}?{query}")
    assert r.status_code in (200, 400), r.content
    assert r["Content-Type"].startswith("application/json")
