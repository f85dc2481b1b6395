"""/healthz and /readyz: ready means Postgres answers; Redis is reported, not required."""

from __future__ import annotations

import pytest


def test_healthz(client):
    r = client.get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


@pytest.mark.django_db
def test_readyz_with_redis_up(client):
    r = client.get("/readyz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "postgres": "ok", "redis": "ok"}


@pytest.mark.django_db
def test_readyz_stays_ready_when_redis_is_down(client, settings, closed_redis_url):
    settings.REDIS_URL = closed_redis_url
    r = client.get("/readyz")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["postgres"] == "ok"
    assert body["redis"].startswith("down")


@pytest.mark.django_db
def test_readyz_reports_redis_stopping_and_coming_back(client, settings, private_redis):
    settings.REDIS_URL = private_redis.url
    assert client.get("/readyz").json()["redis"] == "ok"
    private_redis.stop()
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json()["redis"].startswith("down")
    private_redis.start()
    assert client.get("/readyz").json()["redis"] == "ok"


@pytest.mark.django_db
def test_readyz_without_redis_configured(client, settings):
    settings.REDIS_URL = ""
    r = client.get("/readyz")
    assert r.status_code == 200
    assert r.json()["redis"] == "disabled"
