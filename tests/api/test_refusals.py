"""Odd inputs of issue 28 item 7, each a clear JSON 4xx that writes nothing (each one
below answered 500, an HTML 400 or the wrong bound once)."""

from __future__ import annotations

import ipaddress
import json

import pytest

from jobs import services
from jobs.api.parsers import BATCH_BODY_FACTOR, max_body_bytes
from jobs.events import ssrf
from jobs.models import JobSignal, Schedule, Webhook, Workflow
from tests.api.conftest import counts

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs/"
BATCH = "/api/v1/jobs/batch/"
SCHEDULES = "/api/v1/schedules/"
WORKFLOWS = "/api/v1/workflows/"
WEBHOOKS = "/api/v1/webhooks/"

NUL, SURROGATE = "\\u0000", "\\ud800"  # as JSON escapes: the body stays valid JSON


def post_text(api, url, text, method="post"):
    return getattr(api, method)(url, data=text.encode("utf-8"), content_type="application/json")


def assert_json_4xx(r, status=400, code=None):
    assert r.status_code == status, (r.status_code, r.content[:300])
    assert r["Content-Type"].startswith("application/json"), r["Content-Type"]
    if code is not None:
        assert r.json()["code"] == code or code in json.dumps(r.json().get("errors", {})), r.json()


def everything() -> tuple:
    return (*counts(), Schedule.objects.count(), Workflow.objects.count(),
            Webhook.objects.count(), JobSignal.objects.count())  # fmt: skip


# --- schedule names, workflow names and step ids -----------------------------------


@pytest.mark.parametrize("bad", [NUL, SURROGATE])
def test_a_schedule_name_with_nul_or_a_lone_surrogate_is_400_on_post_and_patch(api, bad):
    before = everything()
    r = post_text(api, SCHEDULES, f'{{"name": "a{bad}", "interval_seconds": 60, "task": "echo"}}')
    assert_json_4xx(r, code="invalid_name")
    assert everything() == before
    made = api.post(
        SCHEDULES, {"name": "ok", "interval_seconds": 60, "task": "echo"}, format="json"
    )
    assert made.status_code == 201
    url = f"{SCHEDULES}{made.json()['id']}/"
    r = post_text(api, url, f'{{"name": "b{bad}"}}', method="patch")
    assert_json_4xx(r, code="invalid_name")
    assert Schedule.objects.get(pk=made.json()["id"]).name == "ok"


@pytest.mark.parametrize("bad", [NUL, SURROGATE])
def test_a_workflow_step_id_or_name_with_nul_or_a_lone_surrogate_is_400(api, bad):
    before = everything()
    step = '{"id": "s' + bad + '", "task": "echo", "payload": {}}'
    r = post_text(api, WORKFLOWS, f'{{"name": "w", "steps": [{step}]}}')
    assert_json_4xx(r)
    assert "steps[0].id" in r.json()["errors"], r.json()
    r = post_text(api, WORKFLOWS, f'{{"name": "w{bad}", "steps": [{{"id": "a", "task": "echo", '
                                  '"payload": {}}]}')  # fmt: skip
    assert_json_4xx(r)
    assert "name" in r.json()["errors"], r.json()
    assert everything() == before


# --- body bounds per endpoint, JSON 413 whatever Django's own upload limit ---------------


def test_the_batch_endpoint_has_its_own_bound(api, settings):
    """DRF asks for the parsers before it sets `action`: the batch got the single bound."""
    settings.JOBS_MAX_PAYLOAD_BYTES = 1024
    single = max_body_bytes()
    jobs = [{"task": "echo", "payload": {"x": "a" * 500}} for _ in range(2 * single // 500)]
    body = json.dumps({"jobs": jobs[:1000]})
    assert single < len(body) < BATCH_BODY_FACTOR * single
    assert post_text(api, BATCH, body).status_code == 201
    before = everything()
    too_big = json.dumps({"jobs": [{"task": "echo", "payload": {"x": "a" * 2000}}] * 1000})
    assert len(too_big) > BATCH_BODY_FACTOR * single
    r = post_text(api, BATCH, too_big)
    assert_json_4xx(r, 413, "request_too_large")
    assert str(BATCH_BODY_FACTOR * single) in r.json()["detail"]
    assert everything() == before


def _schedule_url(me) -> str:
    from jobs.schedules import define

    made = define.create({"name": "bound", "interval_seconds": 60, "task": "echo"},
                         client=me, origin=Schedule.Origin.API)  # fmt: skip
    return f"{SCHEDULES}{made.pk}/"


def _signal_url(me) -> str:
    return f"{JOBS}{services.submit('echo', {}, client_id=me.pk)[0].pk}/signal/"


@pytest.mark.parametrize(
    "method,url,factor",
    [
        ("post", lambda me: JOBS, 1),
        ("post", lambda me: BATCH, BATCH_BODY_FACTOR),
        ("post", lambda me: WORKFLOWS, BATCH_BODY_FACTOR),
        ("post", lambda me: SCHEDULES, 1),
        ("post", lambda me: WEBHOOKS, 1),
        ("post", _signal_url, 1),
        ("patch", _schedule_url, 1),
    ],
)
def test_every_body_past_its_bound_is_a_json_413_naming_the_limit(
    api, me, settings, method, url, factor
):
    """Django's own upload limit (DATA_UPLOAD_MAX_MEMORY_SIZE, an HTML 400 under DRF
    3.18) is set below the bound here: the parser reads the stream itself, only up to
    its bound, so the answer is JSON either way."""
    settings.JOBS_MAX_PAYLOAD_BYTES = 1024
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    limit = factor * max_body_bytes()
    target = url(me)
    before = everything()
    r = post_text(api, target, json.dumps({"task": "echo", "payload": {"x": "a" * limit}}), method)
    assert_json_4xx(r, 413, "request_too_large")
    assert f"the limit is {limit}" in r.json()["detail"]
    assert everything() == before


def test_a_body_past_djangos_upload_limit_but_within_the_bound_is_read(api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    r = post_text(api, JOBS, json.dumps({"task": "echo", "payload": {"x": "a" * 5000}}))
    assert r.status_code == 201, r.content[:300]


# --- the SSRF guard -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    ["2002:7f00:1::", "2002:a9fe:a9fe::", "2002:808:808::", "fec0::1", "feff::1"],
)
def test_6to4_and_site_local_ipv6_are_refused(api, settings, address):
    settings.JOBS_WEBHOOK_ALLOW_PRIVATE = False
    assert ssrf._forbidden(ipaddress.ip_address(address))
    before = everything()
    r = api.post(WEBHOOKS, {"url": f"http://[{address}]/h", "events": ["*"]}, format="json")
    assert_json_4xx(r)
    assert "url" in r.json()["errors"], r.json()
    assert everything() == before


def test_public_ipv6_and_ipv4_stay_allowed():
    assert not ssrf._forbidden(ipaddress.ip_address("2606:4700:4700::1111"))
    assert not ssrf._forbidden(ipaddress.ip_address("8.8.8.8"))


def test_a_refusal_never_says_what_a_name_resolves_to(api, settings):
    """A loopback name and one that does not resolve get the same words: no DNS oracle."""
    settings.JOBS_WEBHOOK_ALLOW_PRIVATE = False
    messages = []
    for host in ("localhost", "no-such-host.invalid"):
        r = api.post(WEBHOOKS, {"url": f"http://{host}:8080/h", "events": ["*"]}, format="json")
        assert_json_4xx(r)
        text = r.json()["errors"]["url"][0]["message"]
        assert "127.0.0.1" not in text and "::1" not in text, text
        messages.append(text.replace(host, "HOST"))
    assert messages[0] == messages[1]


# --- time zones and signal keys -----------------------------------------------------------


@pytest.mark.parametrize("zone", ["localtime", "posixrules"])
def test_a_host_dependent_time_zone_is_refused(api, zone):
    before = everything()
    r = api.post(SCHEDULES, {"name": "z", "interval_seconds": 60, "task": "echo",
                             "timezone": zone}, format="json")  # fmt: skip
    assert_json_4xx(r, code="invalid_timezone")
    assert everything() == before


@pytest.mark.parametrize("key", [" padded ", "tab\t"])
def test_a_signal_key_is_stored_as_sent(api, me, key):
    url = _signal_url(me)
    r = api.post(url, {"key": key}, format="json")
    assert r.status_code == 202 and r.json()["key"] == key
    assert JobSignal.objects.get().key == key


@pytest.mark.parametrize("text", ['{"key": 5}', '{"key": true}', '{"key": ""}',
                                  '{"key": "a\\u0000"}', '{"key": "a\\ud800"}',
                                  '{"key": ["a"]}'])  # fmt: skip
def test_a_signal_key_that_is_not_a_storable_string_is_400(api, me, text):
    url = _signal_url(me)
    before = everything()
    r = post_text(api, url, text)
    assert_json_4xx(r, code="invalid_key")
    assert everything() == before
