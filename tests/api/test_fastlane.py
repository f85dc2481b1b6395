"""The single submission's lane (jobs.api.fastlane, D185): what it serves, it answers as
the full application does, byte for byte; everything else reaches Django unchanged."""

from __future__ import annotations

import io
import json
import re
import sys
from datetime import UTC, datetime, timedelta

import pytest
from django.core.handlers.wsgi import WSGIHandler
from django.db import connection
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from jobs.api.auth import ClientRateThrottle
from jobs.api.fastlane import FastLane
from jobs.api.parsers import max_body_bytes
from jobs.api.renderers import ORJSONRenderer
from jobs.api.serializers import SubmittedJobSerializer
from jobs.models import Job
from tests.api.conftest import new_client
from tests.factories import JobFactory

URL = "/api/v1/jobs/"
BODY = b'{"task": "echo", "payload": {"n": 1}}'
MASKED = ("id", "created_at", "updated_at", "run_at")


class Counted:
    """Django's WSGI application, counting the requests that reach it."""

    def __init__(self) -> None:
        self.app, self.calls = WSGIHandler(), 0

    def __call__(self, environ, start_response):
        self.calls += 1
        return self.app(environ, start_response)


@pytest.fixture
def lane():
    return FastLane(Counted())


def call(app, body=BODY, method="POST", path=URL, **headers):
    environ = {
        "REQUEST_METHOD": method, "PATH_INFO": path, "SCRIPT_NAME": "", "QUERY_STRING": "",
        "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(body)),
        "HTTP_HOST": "127.0.0.1:8000", "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8000",
        "SERVER_PROTOCOL": "HTTP/1.1", "REMOTE_ADDR": "127.0.0.1", "wsgi.url_scheme": "http",
        "wsgi.errors": sys.stderr, "wsgi.input": io.BytesIO(body),
    }  # fmt: skip
    for name, value in headers.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    got = {}

    def start_response(status, headers, exc_info=None):
        got.update(status=status, headers=headers)

    result = app(environ, start_response)
    try:
        content = b"".join(result)
    finally:
        getattr(result, "close", lambda: None)()
    return got["status"], got["headers"], content


def both(lane, **kwargs):
    """(lane on, lane off): the same request through each."""
    on = call(lane, **kwargs)
    served = lane.app.calls == 0
    ClientRateThrottle.reset()
    with override_settings(JOBS_API_FAST_LANE=False):
        off = call(lane, **kwargs)
    return on, off, served


def masked(answer):
    """A submission's answer with what differs between two jobs (id, times) masked."""
    status, headers, content = answer
    try:
        doc = json.loads(content)
    except ValueError:
        return answer
    if not isinstance(doc, dict) or "id" not in doc:
        return answer
    doc = {k: ("*" if k in MASKED else v) for k, v in doc.items()}
    headers = [
        (k, "*" if k == "Content-Length" else re.sub(r"\d+", "*", v) if k == "Location" else v)
        for k, v in headers
    ]
    return status, headers, json.dumps(doc)


def serializers_bytes(job_id: int) -> bytes:
    return ORJSONRenderer().render(SubmittedJobSerializer(Job.objects.get(pk=job_id)).data)


def stored(job_id: int) -> dict:
    row = Job.objects.filter(pk=job_id).values().get()
    return {k: v for k, v in row.items() if k not in (*MASKED, "due_at", "request_hash")}


_text = st.text(st.characters(blacklist_characters="\x00", codec="utf-8"), max_size=10)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)  # fmt: skip
_submissions = st.fixed_dictionaries(
    {"task": st.just("echo"), "payload": _json.filter(lambda v: v is not None)},
    optional={
        "queue": st.sampled_from(["default", "mail"]),
        "priority": st.integers(-10, 10),
        "max_retries": st.integers(0, 5),
        "timeout": st.integers(1, 3600) | st.floats(1, 3600),
        "concurrency_key": st.text("abcxyz-", min_size=1, max_size=10),
        "run_at": st.integers(-3600, 3600).map(
            lambda s: (datetime.now(UTC) + timedelta(seconds=s)).isoformat()
        ),
    },
)


@pytest.mark.django_db(transaction=True)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=_submissions, spaced=st.booleans())
def test_a_valid_submission_gets_the_full_applications_answer_and_row(lane, body, spaced):
    _, token = new_client()
    raw = json.dumps(body, separators=None if spaced else (",", ":")).encode()
    lane.app.calls = 0
    on, off, served = both(lane, body=raw, HTTP_AUTHORIZATION=f"Token {token}")
    assert served, on
    assert on[0] in ("201 Created", "200 OK"), on
    assert masked(on) == masked(off)
    on_id, off_id = json.loads(on[2])["id"], json.loads(off[2])["id"]
    assert on[2] == serializers_bytes(on_id)
    assert dict(on[1])["Location"] == f"/api/v1/jobs/{on_id}/"
    a, b = stored(on_id), stored(off_id)
    assert a == b, {k: (a[k], b[k]) for k in a if a[k] != b[k]}


PRODUCTION = {
    "SECURE_PROXY_SSL_HEADER": ("HTTP_X_FORWARDED_PROTO", "https"),
    "SECURE_SSL_REDIRECT": True,
    "SECURE_REDIRECT_EXEMPT": [r"^healthz$"],
    "SECURE_HSTS_SECONDS": 3600,
    "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
    "SECURE_HSTS_PRELOAD": True,
    "SECURE_REFERRER_POLICY": "same-origin, strict-origin",
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "proto, served", [("https", True), ("https, http", True), ("http", False), (None, False)]
)
def test_behind_a_tls_proxy_the_answer_is_djangos_hsts_and_redirect_included(proto, served):
    _, token = new_client()
    with override_settings(**PRODUCTION):
        lane = FastLane(Counted())
        on, off, lane_served = both(
            lane, HTTP_AUTHORIZATION=f"Token {token}", HTTP_X_FORWARDED_PROTO=proto
        )
    assert lane_served == served
    assert masked(on) == masked(off)
    if served:
        assert dict(on[1])["Strict-Transport-Security"].startswith("max-age=3600")
    else:
        assert on[0].startswith("301")


@pytest.fixture
def failing_insert(django_db_blocker):
    """PostgreSQL refuses the INSERT of a job whose payload says so: a real fault inside
    the service call, after the lane has taken the request."""
    with django_db_blocker.unblock(), connection.cursor() as cur:
        cur.execute(
            "CREATE FUNCTION lane_fault() RETURNS trigger AS $$ BEGIN "
            "RAISE EXCEPTION 'injected'; END $$ LANGUAGE plpgsql;"
            "CREATE TRIGGER lane_fault BEFORE INSERT ON jobs_job FOR EACH ROW "
            "WHEN (NEW.payload ? 'fault') EXECUTE FUNCTION lane_fault()"
        )
    yield
    with django_db_blocker.unblock(), connection.cursor() as cur:
        cur.execute("DROP TRIGGER lane_fault ON jobs_job; DROP FUNCTION lane_fault()")


@pytest.mark.django_db(transaction=True)
def test_an_exception_in_the_service_call_is_djangos_500_and_counted_once(lane, failing_insert):
    _, token = new_client()
    body = b'{"task": "echo", "payload": {"fault": 1}}'
    before = _counts()
    on = call(lane, body=body, HTTP_AUTHORIZATION=f"Token {token}")
    assert lane.app.calls == 0  # answered by the lane: a replay could submit twice
    counted = _delta(before, _counts())
    before = _counts()
    with override_settings(JOBS_API_FAST_LANE=False):
        off = call(lane, body=body, HTTP_AUTHORIZATION=f"Token {token}")
    assert on == off and on[0].startswith("500")
    assert counted == _delta(before, _counts())
    assert not Job.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_live_unique_key_answers_200_with_the_holder_as_django_does(lane):
    _, token = new_client()
    body = b'{"task": "echo", "payload": 1, "unique_key": "only-one"}'
    first = call(lane, body=body, HTTP_AUTHORIZATION=f"Token {token}")
    assert first[0] == "201 Created"
    on, off, served = both(lane, body=body, HTTP_AUTHORIZATION=f"Bearer {token}")
    assert served and on[0] == "200 OK"
    assert on == off


@pytest.mark.django_db(transaction=True)
def test_a_job_parked_by_a_refused_push_answers_as_django_does(lane, settings, closed_redis_url):
    """Redis refuses the push: the new job is parked (enqueue_failed) after its object
    was made, and both paths answer it as its row now reads."""
    _, token = new_client()
    settings.REDIS_URL = closed_redis_url
    on, off, served = both(lane, HTTP_AUTHORIZATION=f"Token {token}")
    assert served and on[0] == "201 Created"
    answer = json.loads(on[2])
    assert answer["status"] == "enqueue_failed"
    assert on[2] == serializers_bytes(answer["id"])  # the row as stored, times included
    assert masked(on) == masked(off)


def _throttled(lane, token):
    with override_settings(REST_FRAMEWORK={"DEFAULT_THROTTLE_RATES": {"client": "1/minute"}}):
        call(lane, HTTP_AUTHORIZATION=f"Token {token}")
        return call(lane, HTTP_AUTHORIZATION=f"Token {token}")


FALL_THROUGH = {
    "a read": {"method": "GET", "body": b""},
    "another path": {"path": "/api/v1/jobs/batch/", "body": b'{"jobs": [{"task": "echo"}]}'},
    "another method": {"method": "PUT"},
    "no token": {"HTTP_AUTHORIZATION": None},
    "a wrong token": {"HTTP_AUTHORIZATION": "Token nope"},
    "another scheme": {"HTTP_AUTHORIZATION": "Basic {token}"},
    "three words": {"HTTP_AUTHORIZATION": "Token {token} more"},
    "invalid JSON": {"body": b'{"task": '},
    "a list": {"body": b'[{"task": "echo"}]'},
    "an unknown field": {"body": b'{"task": "echo", "colour": 1}'},
    "an unknown task": {"body": b'{"task": "no-such-task"}'},
    "an undeclared queue": {"body": b'{"task": "echo", "queue": "nowhere"}'},
    "NaN": {"body": b'{"task": "echo", "payload": NaN}'},
    "a 20-digit number": {"body": b'{"task": "echo", "payload": 18446744073709551616}'},
    "a declared oversized body": {"CONTENT_LENGTH": str(max_body_bytes() + 1)},
    "a short body": {"CONTENT_LENGTH": str(len(BODY) + 5)},
    "a latin-1 charset": {"CONTENT_TYPE": "application/json; charset=latin-1"},
    "text/plain": {"CONTENT_TYPE": "text/plain"},
    "a form": {"CONTENT_TYPE": "application/x-www-form-urlencoded"},
    "no content type": {"CONTENT_TYPE": None},
    "?format=json": {"QUERY_STRING": "format=json"},
    "a bad Content-Length": {"CONTENT_LENGTH": "12x"},
    "a Content_Length header": {"HTTP_CONTENT_LENGTH": "3"},
    "a host not allowed": {"HTTP_HOST": "evil.example"},
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("case", FALL_THROUGH, ids=list(FALL_THROUGH))
def test_anything_else_reaches_django_and_gets_its_answer(lane, case):
    _, token = new_client()
    kwargs = {"HTTP_AUTHORIZATION": f"Token {token}", **FALL_THROUGH[case]}
    if kwargs["HTTP_AUTHORIZATION"]:
        kwargs["HTTP_AUTHORIZATION"] = kwargs["HTTP_AUTHORIZATION"].format(token=token)
    on, off, served = both(lane, **kwargs)
    assert not served
    assert masked(on) == masked(off)


@pytest.mark.django_db(transaction=True)
def test_a_browser_is_djangos_browsable_answer(lane):
    _, token = new_client()
    on, off, served = both(lane, HTTP_AUTHORIZATION=f"Token {token}", HTTP_ACCEPT="text/html")
    assert not served and on[0] == off[0] == "201 Created"
    assert [k for k, _ in on[1]] == [k for k, _ in off[1]]
    assert dict(on[1])["Content-Type"] == "text/html; charset=utf-8"


@pytest.mark.django_db(transaction=True)
def test_an_idempotency_key_repeat_is_djangos(lane):
    _, token = new_client()
    auth = f"Token {token}"
    assert call(lane, HTTP_AUTHORIZATION=auth, HTTP_IDEMPOTENCY_KEY="r-1")[0] == "201 Created"
    on, off, served = both(lane, HTTP_AUTHORIZATION=auth, HTTP_IDEMPOTENCY_KEY="r-1")
    assert not served and on == off and on[0] == "200 OK"
    changed = both(
        lane,
        body=b'{"task": "echo", "payload": 2}',
        HTTP_AUTHORIZATION=auth,
        HTTP_IDEMPOTENCY_KEY="r-1",
    )
    assert changed[0] == changed[1] and changed[0][0].startswith("409")


@pytest.mark.django_db(transaction=True)
def test_backpressure_is_djangos_429(lane):
    _, token = new_client()
    JobFactory.create_batch(2)
    with override_settings(JOBS_MAX_QUEUE_DEPTH=1):
        on, off, served = both(lane, HTTP_AUTHORIZATION=f"Token {token}")
    assert not served
    assert on == off and on[0].startswith("429"), on
    assert Job.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_refusal_after_the_throttle_is_charged_once_as_django_charges_it(lane):
    """The lane counts the request, the service refuses it (a full queue), the view
    answers it and counts it: the lane's count is taken back (D208)."""
    _, token = new_client()
    JobFactory.create_batch(2)
    rates = {"DEFAULT_THROTTLE_RATES": {"client": "2/minute"}}
    with override_settings(JOBS_MAX_QUEUE_DEPTH=1, REST_FRAMEWORK=rates):
        codes = [
            json.loads(call(lane, HTTP_AUTHORIZATION=f"Token {token}")[2])["code"] for _ in range(3)
        ]
    assert codes == ["queue_full", "queue_full", "throttled"]


@pytest.mark.django_db(transaction=True)
def test_throttling_is_djangos_429(lane):
    _, token = new_client()
    on = _throttled(lane, token)
    ClientRateThrottle.reset()
    with override_settings(JOBS_API_FAST_LANE=False):
        off = _throttled(lane, token)
    assert on[0].startswith("429") and masked(on) == masked(off)
    assert lane.app.calls == 3  # the lane served the first request only


@pytest.mark.django_db(transaction=True)
def test_a_deactivated_client_is_refused_at_once_through_the_lane(lane):
    client, token = new_client()
    assert call(lane, HTTP_AUTHORIZATION=f"Token {token}")[0] == "201 Created"
    assert lane.app.calls == 0  # served by the lane, the client cached by now
    client.is_active = False
    client.save()
    on, off, served = both(lane, HTTP_AUTHORIZATION=f"Token {token}")
    assert not served and on == off and on[0].startswith("401")
    assert Job.objects.filter(client=client).count() == 1


def _counts() -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for metric in REGISTRY.collect()
        if metric.name.startswith("django_http")
        for s in metric.samples
        if s.name.endswith(("_total", "_count"))
    }


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


@pytest.mark.django_db(transaction=True)
def test_a_lane_served_request_counts_the_series_the_middleware_counts(lane):
    _, token = new_client()
    before = _counts()
    assert call(lane, HTTP_AUTHORIZATION=f"Token {token}")[0] == "201 Created"
    assert lane.app.calls == 0
    on = _delta(before, _counts())
    before = _counts()
    with override_settings(JOBS_API_FAST_LANE=False):
        assert call(lane, HTTP_AUTHORIZATION=f"Token {token}")[0] == "201 Created"
    off = _delta(before, _counts())
    assert on == off
    key = (
        "django_http_responses_total_by_status_view_method_total",
        (("method", "POST"), ("status", "201"), ("view", "job-list")),
    )
    assert on[key] == 1
