"""The lean single-submission path keeps every guarantee: a cached client is revoked at
once, the admin keeps sessions and CSRF, and the fast serializer, renderer and parser
give exactly what DRF and the standard library give."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client as BrowserClient
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework import serializers
from rest_framework.renderers import JSONRenderer

from jobs import clientcache, services
from jobs.api.parsers import BoundedJSONParser
from jobs.api.renderers import ORJSONRenderer
from jobs.api.serializers import JobSerializer
from jobs.models import Client, Job
from jobs.services import common
from tests.api.conftest import authed, new_client
from tests.factories import JobFactory

URL = "/api/v1/jobs/"
BODY = json.dumps({"task": "echo", "payload": {"n": 1}})


def client_queries(ctx: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in ctx.captured_queries if '"jobs_client"' in q["sql"]]


# --- the client cache -------------------------------------------------------------------


@pytest.mark.django_db
def test_a_known_token_needs_no_client_query():
    _, token = new_client()
    api = authed(token)
    assert api.get(URL).status_code == 200  # reads the row, fills the cache
    with CaptureQueriesContext(connection) as ctx:
        r = api.post(URL, data=BODY, content_type="application/json")
    assert r.status_code == 201, r.content
    assert client_queries(ctx) == []
    assert Job.objects.get(pk=r.json()["id"]).client.name == r.wsgi_request.user.name


@pytest.mark.django_db
def test_deactivating_a_cached_client_refuses_its_next_request():
    client, token = new_client()
    api = authed(token)
    assert api.get(URL).status_code == 200
    assert clientcache.active_client(client.token_hash) is not None  # cached now
    assert services.deactivate_clients([client.pk]) == [client.pk]
    r = api.post(URL, data=BODY, content_type="application/json")
    assert r.status_code == 401, r.content
    assert r.json()["code"] == "authentication_failed"
    assert not Job.objects.filter(client=client).exists()


@pytest.mark.django_db
def test_the_admin_action_revokes_a_cached_client_at_once(client):
    api_client, token = new_client()
    api = authed(token)
    assert api.get(URL).status_code == 200
    client.force_login(User.objects.create_superuser("root", password="pw"))
    r = client.post(
        reverse("admin:jobs_client_changelist"),
        {"action": "deactivate_clients", "_selected_action": [api_client.pk]},
    )
    assert r.status_code == 302
    assert api.get(URL).status_code == 401


@pytest.mark.django_db
def test_saving_or_deleting_a_client_drops_its_cached_entry():
    client, token = new_client()
    api = authed(token)
    assert api.get(URL).status_code == 200
    client.is_active = False
    client.save()
    assert api.get(URL).status_code == 401
    client.is_active = True
    client.save()
    assert api.get(URL).status_code == 200
    client.delete()
    assert api.get(URL).status_code == 401


@pytest.mark.django_db
def test_a_reader_that_saw_the_old_row_cannot_put_it_back():
    """Reader fetched the active row, then the client is deactivated, then the reader
    stores what it read: the tombstone wins, so the next request reads the database."""
    client, token = new_client()
    stale = Client.objects.get(pk=client.pk)  # what a slow reader fetched
    services.deactivate_clients([client.pk])
    clientcache._cache().add(client.token_hash, (stale.pk, stale.name), 60)
    assert authed(token).get(URL).status_code == 401


# --- middleware ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_api_answers_set_no_cookie_and_need_no_csrf_token():
    _, token = new_client()
    api = authed(token)
    api.enforce_csrf_checks = True
    api.cookies["sessionid"] = "whatever"
    api.cookies["csrftoken"] = "x" * 32
    r = api.post(URL, data=BODY, content_type="application/json")
    assert r.status_code == 201, r.content
    assert "Set-Cookie" not in r.headers
    assert "Cookie" not in r.headers.get("Vary", "")
    # Neither a session nor messages were set up for it (CSRF: DRF exempts token views).
    request = r.wsgi_request
    assert not hasattr(request, "session") and not hasattr(request, "_messages")


@pytest.mark.django_db
def test_the_admin_still_enforces_csrf_and_keeps_its_session():
    User.objects.create_superuser("root", password="pw")
    browser = BrowserClient(enforce_csrf_checks=True)
    login = reverse("admin:login")
    r = browser.post(login, {"username": "root", "password": "pw", "next": "/admin/"})
    assert r.status_code == 403  # no CSRF token
    page = browser.get(login)
    token = page.cookies["csrftoken"].value
    r = browser.post(
        login,
        {"username": "root", "password": "pw", "next": "/admin/", "csrfmiddlewaretoken": token},
    )
    assert r.status_code == 302 and r["Location"] == "/admin/"
    assert browser.get("/admin/").status_code == 200  # the session holds the login


# --- the same bytes and values as before -------------------------------------------------


@pytest.mark.django_db
def test_fast_job_representation_equals_modelserializers():
    client, _ = new_client()
    now = datetime.now(UTC)
    fresh, _ = services.submit("echo", {"n": 1, "s": "é\u2028"}, client_id=client.pk)
    later, _ = services.submit(
        "echo",
        [1, 2.5, None],
        run_at=now + timedelta(hours=1),
        idempotency_key="k-1",
        request_hash="h",
        client_id=client.pk,
    )
    jobs = [
        fresh,  # as the INSERT ... RETURNING built it
        later,
        JobFactory.create(status="done", client_id=client.pk),
        JobFactory.create(status="failed", client_id=client.pk),
        JobFactory.create(status="processing"),
        *Job.objects.filter(pk__in=[fresh.pk, later.pk]),
    ]
    for job in jobs:
        generic = serializers.ModelSerializer.to_representation(JobSerializer(job), job)
        assert JobSerializer(job).data == generic
        assert list(JobSerializer(job).data) == list(generic)
    many = JobSerializer(jobs, many=True).data
    generic = serializers.ModelSerializer.to_representation
    assert many == [generic(JobSerializer(j), j) for j in jobs]


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_json)
def test_orjson_renderer_writes_drfs_document(value):
    """The same JSON value (floats may be spelt 1e-07 or 1e-7) and otherwise the same bytes."""
    fast, drf = ORJSONRenderer().render(value), JSONRenderer().render(value)
    if value is None:  # no body at all, as DRF
        assert fast == drf == b""
        return
    assert json.loads(fast) == json.loads(drf)
    if b"e" not in drf and b"." not in drf:
        assert fast == drf
    assert "\u2028".encode() not in fast and "\u2029".encode() not in fast


def test_orjson_renderer_escapes_line_separators_and_defers_to_drf_for_the_rest():
    text = {"s": "a\u2028b\u2029c é"}
    assert ORJSONRenderer().render(text) == JSONRenderer().render(text)
    odd = {"at": datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC), "big": 2**70}
    assert ORJSONRenderer().render(odd) == JSONRenderer().render(odd)


class _Stream:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def read(self, n: int) -> bytes:
        return self.raw[:n]


@settings(max_examples=300, deadline=None)
@given(_json)
def test_parser_reads_what_the_standard_library_reads(value):
    raw = json.dumps(value, ensure_ascii=bool(len(str(value)) % 2)).encode()
    got = BoundedJSONParser().parse(_Stream(raw), "application/json")
    assert got == json.loads(raw) and type(got) is type(json.loads(raw))


@pytest.mark.parametrize(
    "raw", [b'{"a": NaN}', b"[Infinity]", b'"\\ud800"', b"123456789012345678901234567890"]
)
def test_parser_keeps_the_standard_librarys_answers_at_the_edges(raw):
    from rest_framework.exceptions import ParseError

    try:
        expected = json.loads(raw, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except ValueError:
        with pytest.raises(ParseError):
            BoundedJSONParser().parse(_Stream(raw), "application/json")
        return
    assert BoundedJSONParser().parse(_Stream(raw), "application/json") == expected


# --- a failing cache ----------------------------------------------------------------------


def _cache_at(settings, url: str) -> None:
    settings.CACHES = {
        **settings.CACHES,
        "api_clients": {**settings.CACHES["api_clients"], "LOCATION": url},
    }


@pytest.mark.django_db
def test_a_stopped_cache_leaves_authentication_to_the_database(settings, private_redis):
    _cache_at(settings, private_redis.url)
    client, token = new_client()
    api = authed(token)
    assert api.get(URL).status_code == 200
    assert private_redis.client().keys("*client*")  # cached there
    private_redis.stop()
    assert api.post(URL, data=BODY, content_type="application/json").status_code == 201
    services.deactivate_clients([client.pk])  # the tombstone cannot be written: logged
    assert api.get(URL).status_code == 401  # the database answers


@pytest.mark.django_db
def test_a_frozen_cache_costs_one_timeout_per_request(settings, private_redis):
    _cache_at(settings, private_redis.url)
    _, token = new_client()
    api = authed(token)
    assert api.get(URL).status_code == 200
    os.kill(private_redis.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert api.get(URL).status_code == 200
        took = time.monotonic() - started
    finally:
        os.kill(private_redis.proc.pid, signal.SIGCONT)
    timeout = settings.CACHES["api_clients"]["OPTIONS"]["socket_timeout"]
    # One read timeout, not a second one for storing the answer (generous for a busy machine).
    assert took < 2 * timeout, took


@pytest.mark.django_db
def test_the_client_cache_keeps_one_redis_client_and_survives_a_redis_restart(
    settings, private_redis
):
    """One `redis.Redis` per pool for every request (Django builds one per call); its
    pool reconnects after Redis comes back, so the cache serves again."""
    from django.core.cache import caches

    _cache_at(settings, private_redis.url)
    cache = caches["api_clients"]._cache
    assert cache.get_client() is cache.get_client()
    assert cache.get_client(write=True) is cache.get_client()  # one server: one pool
    _, token = new_client()
    api = authed(token)
    assert api.get(URL).status_code == 200
    private_redis.stop()
    assert api.get(URL).status_code == 200  # the database answers
    private_redis.start()
    assert api.get(URL).status_code == 200
    assert private_redis.client().keys("*client*")  # cached again through the same client


# --- content negotiation ------------------------------------------------------------------


@pytest.mark.parametrize("accept", [None, "", "*/*", "application/json"])
@pytest.mark.parametrize("query", ["", "format=json", "format=api", "page_size=2"])
def test_the_json_first_shortcut_answers_as_drfs_negotiation(accept, query):
    """For the Accept headers the shortcut answers itself, the renderer and media type are
    DRF's own choice; with any query string it is DRF that decides."""
    from rest_framework.negotiation import DefaultContentNegotiation
    from rest_framework.request import Request
    from rest_framework.test import APIRequestFactory

    from jobs.api.renderers import JSONFirstNegotiation
    from jobs.api.views import JobViewSet

    extra = {} if accept is None else {"HTTP_ACCEPT": accept}
    request = Request(APIRequestFactory().get(URL + ("?" + query if query else ""), **extra))
    renderers = JobViewSet().get_renderers()

    def choice(negotiation):
        try:
            renderer, media_type = negotiation.select_renderer(request, renderers)
        except Exception as exc:  # DRF's refusals must be the same too
            return type(exc).__name__
        return type(renderer).__name__, media_type

    assert choice(JSONFirstNegotiation()) == choice(DefaultContentNegotiation())


@pytest.mark.django_db
def test_an_api_answer_keeps_its_content_type_with_and_without_accept():
    _, token = new_client()
    api = authed(token)
    for accept in (None, "*/*", "application/json", "text/html"):
        extra = {} if accept is None else {"HTTP_ACCEPT": accept}
        r = api.get(URL, **extra)
        assert r.status_code == 200
        expected = "text/html" if accept == "text/html" else "application/json"
        assert r["Content-Type"].startswith(expected), (accept, r["Content-Type"])


# --- the API's request metrics --------------------------------------------------------------


def _sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.django_db
def test_a_submission_is_counted_by_status_view_and_method_and_timed():
    _, token = new_client()
    labels = {"view": "job-list", "method": "POST"}
    before = (
        _sample("django_http_responses_total_by_status_total", status="201"),
        _sample("django_http_responses_total_by_status_view_method_total", status="201", **labels),
        _sample("django_http_requests_latency_seconds_by_view_method_count", **labels),
        _sample("django_http_requests_total_by_method_total", method="POST"),
    )
    r = authed(token).post(URL, data=BODY, content_type="application/json")
    assert r.status_code == 201, r.content
    after = (
        _sample("django_http_responses_total_by_status_total", status="201"),
        _sample("django_http_responses_total_by_status_view_method_total", status="201", **labels),
        _sample("django_http_requests_latency_seconds_by_view_method_count", **labels),
        _sample("django_http_requests_total_by_method_total", method="POST"),
    )
    # The kept series count it; the per-method count is one of those no longer written.
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1, 0]


# --- hot statements ------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_hot_statements_reuse_one_cursor_per_statement_and_survive_a_new_connection():
    first = common._hot_rows("SELECT %s::int + 1", [1])
    assert first == [(2,)]
    cursors = connection.connection.__dict__["_jobs_hot_cursors"]
    kept = cursors["SELECT %s::int + 1"]
    assert common._hot_rows("SELECT %s::int + 1", [41]) == [(42,)]
    assert cursors["SELECT %s::int + 1"] is kept  # its loaders are kept with it
    from django.db import DataError

    with pytest.raises(DataError):  # an error leaves the cursor usable
        common._hot_rows("SELECT %s::int + 1", ["x"])
    assert common._hot_rows("SELECT %s::int + 1", [2]) == [(3,)]
    connection.close()
    assert common._hot_rows("SELECT %s::int + 1", [3]) == [(4,)]
    assert connection.connection.__dict__["_jobs_hot_cursors"]["SELECT %s::int + 1"] is not kept
