"""Every API call needs an active client's token; throttling is per client."""

from __future__ import annotations

import json
import time
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from jobs import services
from jobs.models import Client, Job
from tests.api.conftest import RecordingAPIClient, authed, counts

URL = "/api/v1/jobs/"
BODY = json.dumps({"task": "echo", "payload": {}})


def with_header(value: str) -> RecordingAPIClient:
    api = RecordingAPIClient()
    api.credentials(HTTP_AUTHORIZATION=value)
    return api


@pytest.mark.django_db
@pytest.mark.parametrize(
    "header,code",
    [
        (None, "not_authenticated"),
        ("Bearer abc", "authentication_failed"),  # Bearer is read like Token
        ("Basic abc", "authentication_failed"),  # a scheme of its own: the answer names ours
        ("Token", "authentication_failed"),
        ("Token a b", "authentication_failed"),
        ("Token not-a-real-token", "authentication_failed"),
    ],
)
def test_requests_without_a_valid_token_are_401(me, header, code):
    api = RecordingAPIClient() if header is None else with_header(header)
    before = counts()
    for method, path in [
        ("post", URL),
        ("get", URL),
        ("get", f"{URL}1/"),
        ("post", f"{URL}1/cancel/"),
        ("get", f"{URL}1/history/"),
    ]:
        if method == "post":
            r = api.post(path, data=BODY, content_type="application/json")
        else:
            r = api.get(path)
        assert r.status_code == 401, (method, path, r.content)
        assert r.json()["code"] == code
        assert r["WWW-Authenticate"] == "Token"
    assert counts() == before


@pytest.mark.django_db
def test_inactive_client_is_401(client_and_token):
    client, token = client_and_token
    api = authed(token)
    assert api.get(URL).status_code == 200
    services.deactivate_clients([client.pk])  # the client cache forgets it at once
    r = api.get(URL)
    assert r.status_code == 401
    assert r.json()["code"] == "authentication_failed"


@pytest.mark.django_db
def test_only_the_hash_of_a_token_is_stored(client_and_token):
    client, token = client_and_token
    stored = Client.objects.get(pk=client.pk)
    assert stored.token_hash == Client.hash_token(token)
    assert token not in stored.token_hash


@pytest.mark.django_db
def test_throttle_is_per_client(api, other, settings):
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {"client": "3/minute"},
    }
    for _ in range(3):
        assert api.get(URL).status_code == 200
    r = api.get(URL)
    assert r.status_code == 429
    assert r.json()["code"] == "throttled"
    assert int(r["Retry-After"]) > 0
    _, bob_api = other
    assert bob_api.get(URL).status_code == 200


@pytest.mark.django_db
def test_createclient_prints_a_working_token_last():
    out = StringIO()
    call_command("createclient", "demo", stdout=out)
    lines = out.getvalue().strip().splitlines()
    token = lines[-1]
    assert len(lines) > 1 and " " not in token
    client = Client.objects.get(name="demo")
    assert client.token_hash == Client.hash_token(token)
    r = authed(token).post(URL, data=BODY, content_type="application/json")
    assert r.status_code == 201
    assert Job.objects.get(pk=r.json()["id"]).client == client


@pytest.mark.django_db
def test_createclient_refuses_a_duplicate_name():
    call_command("createclient", "demo", stdout=StringIO())
    with pytest.raises(CommandError, match="already exists"):
        call_command("createclient", "demo", stdout=StringIO())
    assert Client.objects.filter(name="demo").count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["", "   ", "x" * 101])
def test_createclient_refuses_a_bad_name(name):
    with pytest.raises(CommandError):
        call_command("createclient", name, stdout=StringIO())
    assert Client.objects.count() == 0


@pytest.mark.django_db
def test_throttle_window_slides_and_retry_after_follows_drf(api, settings):
    """The per-process counts give DRF's answers: N per window, the oldest request
    leaving the window frees a slot, Retry-After by DRF's arithmetic."""
    from jobs.api.auth import ClientRateThrottle

    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {"client": "2/minute"},
    }
    clock = [1000.0]
    ClientRateThrottle.timer = lambda self: clock[0]
    try:
        assert api.get(URL).status_code == 200
        clock[0] += 30
        assert api.get(URL).status_code == 200
        clock[0] += 10
        r = api.get(URL)
        assert r.status_code == 429
        # DRF: (60 - (now - oldest)) / (2 - 2 + 1) = 20 s.
        assert r["Retry-After"] == "20"
        clock[0] += 20.5  # the first request has left the window
        assert api.get(URL).status_code == 200
        assert api.get(URL).status_code == 429
    finally:
        del ClientRateThrottle.timer


def test_throttle_cost_does_not_grow_with_the_requests_in_the_window():
    """DRF's list in the cache costs a request time in proportion to the window (1.2 ms
    at 30,000 requests); a deque does not. Compared with itself, best of three."""
    from types import SimpleNamespace

    from jobs.api.auth import ClientRateThrottle

    def per_call(prefilled: int) -> float:
        ClientRateThrottle.reset()
        throttle = ClientRateThrottle()
        throttle.num_requests, throttle.duration = 10**9, 3600
        request = SimpleNamespace(user=Client(pk=prefilled + 1, name="t"))
        for _ in range(prefilled):
            throttle.allow_request(request, None)
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for _ in range(2000):
                throttle.allow_request(request, None)
            best = min(best, (time.perf_counter() - started) / 2000)
        return best

    try:
        empty, full = per_call(0), per_call(50_000)
    finally:
        ClientRateThrottle.reset()
    print(f"throttle per request: {empty * 1e6:.1f} us empty, {full * 1e6:.1f} us at 50,000")
    assert full < 5 * empty + 20e-6, (empty, full)
