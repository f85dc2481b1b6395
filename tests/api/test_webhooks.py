"""The webhooks API (issue 16): CRUD per client, the secret once, SSRF refusals that write
nothing, deliveries and redelivery of dead letters."""

from __future__ import annotations

import pytest
from standardwebhooks.webhooks import Webhook as Verifier

from jobs import services
from jobs.events import signing
from jobs.models import Webhook, WebhookDelivery

HOOK = {"url": "http://127.0.0.1:9/hook", "events": ["job.done", "job.failed"]}


@pytest.fixture(autouse=True)
def _allow_private(settings):
    settings.JOBS_WEBHOOK_ALLOW_PRIVATE = True


def test_create_answers_the_secret_once_and_it_signs(api, me):
    r = api.post("/api/v1/webhooks/", HOOK, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["secret"].startswith("whsec_") and body["events"] == ["job.done", "job.failed"]
    assert body["enabled"] is True
    hook = Webhook.objects.get(pk=body["id"])
    assert body["secret"] not in str(vars(hook))  # not stored, derived
    headers = signing.sign(hook.secret_salt, "evt_1", __import__("datetime").datetime.now(), "{}")
    assert Verifier(body["secret"]).verify("{}", headers) == {}
    listed = api.get("/api/v1/webhooks/").json()
    assert [h["id"] for h in listed] == [body["id"]] and "secret" not in listed[0]
    assert "secret" not in api.get(f"/api/v1/webhooks/{body['id']}/").json()


def test_rotate_changes_the_secret(api):
    created = api.post("/api/v1/webhooks/", HOOK, format="json").json()
    rotated = api.post(f"/api/v1/webhooks/{created['id']}/rotate-secret/")
    assert rotated.status_code == 200
    assert rotated.json()["secret"].startswith("whsec_")
    assert rotated.json()["secret"] != created["secret"]


def test_patch_and_delete(api):
    hook = api.post("/api/v1/webhooks/", HOOK, format="json").json()
    r = api.patch(f"/api/v1/webhooks/{hook['id']}/", {"events": ["*"], "enabled": False},
                  format="json")  # fmt: skip
    assert r.status_code == 200 and r.json()["events"] == ["*"] and r.json()["enabled"] is False
    assert api.delete(f"/api/v1/webhooks/{hook['id']}/").status_code == 204
    assert not Webhook.objects.filter(pk=hook["id"]).exists()


def test_another_clients_webhook_is_a_404(api, other):
    hook = api.post("/api/v1/webhooks/", HOOK, format="json").json()
    _, bob = other
    for call in (
        lambda: bob.get(f"/api/v1/webhooks/{hook['id']}/"),
        lambda: bob.patch(f"/api/v1/webhooks/{hook['id']}/", {"enabled": False}, format="json"),
        lambda: bob.delete(f"/api/v1/webhooks/{hook['id']}/"),
        lambda: bob.post(f"/api/v1/webhooks/{hook['id']}/rotate-secret/"),
        lambda: bob.get(f"/api/v1/webhooks/{hook['id']}/deliveries/"),
        lambda: bob.post(f"/api/v1/webhooks/{hook['id']}/deliveries/1/redeliver/"),
    ):
        assert call().status_code == 404
    assert bob.get("/api/v1/webhooks/").json() == []
    assert Webhook.objects.get(pk=hook["id"]).enabled is True


@pytest.mark.parametrize(
    "body, field",
    [
        ({"url": "ftp://example.com/", "events": ["*"]}, "url"),
        ({"url": "http://127.0.0.1:9/", "events": []}, "events"),
        ({"url": "http://127.0.0.1:9/", "events": ["job.exploded"]}, "events"),
        ({"url": "http://127.0.0.1:9/", "events": ["*"], "secret": "mine"}, "secret"),
        ({"events": ["*"]}, "url"),
    ],
    ids=["scheme", "no-events", "unknown-event", "unknown-field", "no-url"],
)
def test_refusals_are_400_and_write_nothing(api, body, field):
    r = api.post("/api/v1/webhooks/", body, format="json")
    assert r.status_code == 400, r.content
    assert any(k.split(".")[0] == field for k in r.json()["errors"]), r.json()
    assert Webhook.objects.count() == 0


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1/", "http://10.0.0.5/", "http://169.254.169.254/latest/meta-data/",
     "http://[::1]/", "http://192.168.1.1/", "http://localhost:8000/", "http://0.0.0.0/"],
    ids=["loopback", "private", "metadata", "ipv6-loopback", "private-192", "localhost",
         "unspecified"],
)  # fmt: skip
def test_private_addresses_are_refused_without_the_setting(api, settings, url):
    settings.JOBS_WEBHOOK_ALLOW_PRIVATE = False
    r = api.post("/api/v1/webhooks/", {"url": url, "events": ["*"]}, format="json")
    assert r.status_code == 400, r.content
    assert r.json()["errors"]["url"][0]["code"] == "unsafe_url"
    assert Webhook.objects.count() == 0


def test_production_needs_https(api, settings):
    settings.PRODUCTION = True
    r = api.post("/api/v1/webhooks/", HOOK, format="json")
    assert r.status_code == 400 and "https" in r.json()["errors"]["url"][0]["message"]


def test_dead_letters_are_listed_and_redelivered(api, me):
    hook = Webhook.objects.create(client=me, url=HOOK["url"], events=["*"], secret_salt="s")
    dead, _ = services.submit(signing.DELIVER_TASK, {"delivery_id": 0}, queue="webhooks",
                              max_retries=0)  # fmt: skip
    ok, _ = services.submit(signing.DELIVER_TASK, {"delivery_id": 0}, queue="webhooks")
    services.fail([(services.claim("w", dead.pk), "webhook answered HTTP 500", False)])
    services.complete([(services.claim("w", ok.pk), {"status": 200})])
    common = {"webhook": hook, "source_job_id": 1, "type": "job.done", "body": "{}"}
    d1 = WebhookDelivery.objects.create(event_id=1, seq=1, job_id=dead.pk, **common)
    WebhookDelivery.objects.create(event_id=2, seq=2, job_id=ok.pk, **common)
    r = api.get(f"/api/v1/webhooks/{hook.pk}/deliveries/?status=failed")
    assert r.status_code == 200
    rows = r.json()["results"]
    assert [(d["id"], d["status"], d["message_id"]) for d in rows] == [(d1.pk, "failed", "evt_1")]
    assert rows[0]["error"] == "webhook answered HTTP 500"
    everything = api.get(f"/api/v1/webhooks/{hook.pk}/deliveries/").json()["results"]
    assert [d["status"] for d in everything] == ["delivered", "failed"]
    assert api.get(f"/api/v1/webhooks/{hook.pk}/deliveries/?status=nope").status_code == 400
    r = api.post(f"/api/v1/webhooks/{hook.pk}/deliveries/{d1.pk}/redeliver/")
    assert r.status_code == 200 and r.json()["status"] == "pending"
    again = api.post(f"/api/v1/webhooks/{hook.pk}/deliveries/{d1.pk}/redeliver/")
    assert again.status_code == 409 and again.json()["code"] == "not_failed"
