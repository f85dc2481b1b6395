"""Webhook deliveries contained (issue 27 item 4), piece by piece against real services: a
total deadline per attempt against receivers that trickle bytes over real sockets (TLS
included), the endpoint slots (PostgreSQL advisory locks held by other sessions), the
circuit breaker's moves under the job fence, its state in the API and the admin, and
how runworker splits the delivery queue off."""

from __future__ import annotations

import re
import socket
import ssl
import threading
import time
from datetime import timedelta

import psycopg
import pytest
from django.urls import reverse
from django.utils import timezone

from jobs import deliveries, services
from jobs.dispatch import parse_queues
from jobs.events import circuit, endpoints, signing
from jobs.events.deadline import DeadlineExceeded
from jobs.events.webhooks import post
from jobs.models import CircuitState, Client, Webhook
from tests.harness import database_url
from tests.test_webhook_delivery import certificate

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n" + b"x" * 40


class Trickler:
    """A receiver on 127.0.0.1 that reads the request, then sends its answer one byte every
    `every` seconds: from the status line (`part="head"`) or after a whole head
    (`part="body"`). Per-read timeouts never fire against it."""

    def __init__(self, every: float, part: str = "head", tls: ssl.SSLContext | None = None):
        self.every = every
        self.part = part
        self.tls = tls
        self.sent = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            # The whole request, body included: closing with unread bytes would send a
            # reset that can reach the sender before the answer is read.
            request_head, _, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", request_head)
            while length and len(body) < int(length.group(1)):
                body += conn.recv(65536)
            head, _, answer = ANSWER.partition(b"\r\n\r\n")
            if self.part == "body":
                conn.sendall(head + b"\r\n\r\n")
            else:
                answer = ANSWER
            for byte in answer:
                conn.sendall(bytes([byte]))
                self.sent += 1
                if self.closed.wait(self.every):
                    return
        except OSError:
            pass  # the sender gave up: what the deadline is for
        finally:
            conn.close()

    def close(self) -> None:
        self.closed.set()
        self.server.close()


@pytest.mark.parametrize("part", ["head", "body"])
def test_a_trickling_receiver_cannot_stretch_an_attempt_past_its_deadline(settings, part):
    settings.JOBS_WEBHOOK_READ_TIMEOUT = 10.0  # each read gets a byte well within this
    receiver = Trickler(0.2, part)
    try:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="within 1.5 s"):
            post(f"http://127.0.0.1:{receiver.port}/h", "127.0.0.1", {}, "{}", seconds=1.5)
        took = time.monotonic() - started
        print(f"{part}: ended after {took:.2f}s, {receiver.sent} bytes trickled")
        assert 1.5 <= took < 2.0
        assert receiver.sent >= 4  # it really trickled: no per-read timeout ended it
    finally:
        receiver.close()


def test_the_deadline_holds_over_tls(settings, tmp_path):
    cert, key = certificate(tmp_path, "localhost")
    settings.JOBS_WEBHOOK_CA_BUNDLE = str(cert)
    settings.JOBS_WEBHOOK_READ_TIMEOUT = 10.0
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    receiver = Trickler(0.2, "head", tls=context)
    try:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            post(f"https://localhost:{receiver.port}/h", "127.0.0.1", {}, "{}", seconds=1.5)
        assert 1.5 <= time.monotonic() - started < 2.0 and receiver.sent >= 4
    finally:
        receiver.close()


def test_a_prompt_answer_is_not_cut(settings):
    receiver = Trickler(0.0, "head")
    try:
        code, head, _ = post(f"http://127.0.0.1:{receiver.port}/h", "127.0.0.1", {}, "{}",
                             seconds=5)  # fmt: skip
        assert (code, head) == (200, b"x" * 40)
    finally:
        receiver.close()


# --- the breaker and the slots, in PostgreSQL ------------------------------------------------


@pytest.fixture
def hook(db):
    owner = Client.objects.create(name="owner", token_hash="o" * 64)
    return Webhook.objects.create(client=owner, url="https://example.com/h", events=["*"],
                                  secret_salt="s")  # fmt: skip


def held_fence(worker: str = "w1") -> tuple[dict, services.Lease]:
    job, _ = services.submit(signing.DELIVER_TASK, {"delivery_id": 0}, queue="webhooks")
    lease = services.claim(worker, job.pk)
    return {"job": lease.job_id, "lv": lease.lease_version, "owner": worker}, lease


def test_failures_in_a_row_open_the_circuit_then_a_probe_closes_it(hook, settings):
    settings.JOBS_WEBHOOK_CIRCUIT_FAILURES = 3
    settings.JOBS_WEBHOOK_CIRCUIT_OPEN_SECONDS = 10
    fence, _ = held_fence()
    assert circuit.admit(hook.pk, fence).go
    assert [circuit.failed(hook.pk, fence) for _ in range(3)] == ["closed", "closed", "open"]
    hook.refresh_from_db()
    assert (hook.circuit_state, hook.circuit_failures) == ("open", 3)
    verdict = circuit.admit(hook.pk, fence)
    assert not verdict.go and verdict.reason == "open" and 9 <= verdict.wait <= 11
    # The period is over: the first attempt probes, the next waits for the probe.
    Webhook.objects.filter(pk=hook.pk).update(circuit_open_until=timezone.now() - timedelta(1))
    assert circuit.describe(Webhook.objects.get(pk=hook.pk))["state"] == "half_open"
    assert circuit.admit(hook.pk, fence) == circuit.Verdict(True, probe=True)
    waiting = circuit.admit(hook.pk, fence)
    assert not waiting.go and waiting.reason == "probing" and waiting.wait <= 3
    assert circuit.answered(hook.pk, fence) is True  # the probe's answer closes it
    hook.refresh_from_db()
    assert (hook.circuit_state, hook.circuit_failures, hook.circuit_open_until) == (
        "closed", 0, None)  # fmt: skip
    assert circuit.answered(hook.pk, fence) is False  # nothing to reset: no write


def test_each_further_failure_doubles_the_open_period_up_to_the_max(hook, settings):
    settings.JOBS_WEBHOOK_CIRCUIT_FAILURES = 1
    settings.JOBS_WEBHOOK_CIRCUIT_OPEN_SECONDS = 10
    settings.JOBS_WEBHOOK_CIRCUIT_MAX_OPEN_SECONDS = 35
    fence, _ = held_fence()
    waits = []
    for _ in range(4):
        circuit.failed(hook.pk, fence)
        waits.append(round(circuit.admit(hook.pk, fence).wait))
    assert 10 <= waits[0] <= 11 and 20 <= waits[1] <= 21
    assert all(35 <= w <= 36 for w in waits[2:])


def test_a_stale_attempt_changes_nothing(hook, settings):
    settings.JOBS_WEBHOOK_CIRCUIT_FAILURES = 1
    fence, lease = held_fence()
    services.release([lease])  # the lease is bumped: this attempt holds nothing now
    assert circuit.failed(hook.pk, fence) is None
    Webhook.objects.filter(pk=hook.pk).update(circuit_state="open", circuit_failures=1,
                                              circuit_open_until=timezone.now())  # fmt: skip
    assert circuit.answered(hook.pk, fence) is False
    assert not circuit.admit(hook.pk, fence).probe  # nor can it take the probe
    hook.refresh_from_db()
    assert (hook.circuit_state, hook.circuit_failures) == ("open", 1)


def test_the_reaper_exports_how_many_enabled_endpoints_are_open(hook, settings):
    """jobs_webhook_circuits{state} counts enabled endpoints by breaker state, every state
    present; a disabled endpoint's circuit is not counted (nothing is delivered to it)."""
    from jobs.collectors import WebhookCircuitsCollector

    def gauge() -> dict[str, float]:
        (family,) = WebhookCircuitsCollector(cache_seconds=0).collect()
        return {s.labels["state"]: s.value for s in family.samples}

    assert gauge() == {"closed": 1, "open": 0, "half_open": 0}
    settings.JOBS_WEBHOOK_CIRCUIT_FAILURES = 1
    fence, _ = held_fence()
    assert circuit.failed(hook.pk, fence) == "open"
    Webhook.objects.create(client=hook.client, url="https://example.com/off", events=["*"],
                           secret_salt="s", enabled=False, circuit_state="open")  # fmt: skip
    assert gauge() == {"closed": 0, "open": 1, "half_open": 0}


def test_no_breaker_when_the_threshold_is_zero(hook, settings):
    settings.JOBS_WEBHOOK_CIRCUIT_FAILURES = 0
    fence, _ = held_fence()
    for _ in range(20):
        circuit.failed(hook.pk, fence)
    assert circuit.admit(hook.pk, fence).go


def test_endpoint_slots_are_bounded_across_sessions(hook, settings):
    """Other sessions (other worker processes) hold the endpoint's slots: none is left
    here; one given back is taken at once. Another endpoint is not affected."""
    settings.JOBS_WEBHOOK_ENDPOINT_CONCURRENCY = 2
    slots = endpoints.Slots()
    others = [psycopg.connect(database_url(), autocommit=True) for _ in range(2)]
    try:
        for slot, conn in enumerate(others):
            conn.execute("SELECT pg_advisory_lock(%s, %s)",
                         [endpoints.ENDPOINT_LOCK_SPACE + slot, hook.pk])  # fmt: skip
        assert slots.take(hook.pk) is None
        other = slots.take(hook.pk + 1)
        assert other is not None
        others[1].execute("SELECT pg_advisory_unlock_all()")
        taken = slots.take(hook.pk)
        assert taken is not None and taken.slot.number == 1
        taken.give()
        other.give()
        assert slots.release_idle() == 2
        # Given back: the other session takes it again.
        again = [endpoints.ENDPOINT_LOCK_SPACE + 1, hook.pk]
        assert others[1].execute("SELECT pg_try_advisory_lock(%s, %s)", again).fetchone()[0]
    finally:
        slots.close()
        for conn in others:
            conn.close()


def test_the_api_and_the_admin_show_the_circuit(db, client):
    from rest_framework.test import APIClient

    from tests.test_admin import make_staff

    owner, token = Client.create_with_token("circuit-owner")
    hook = Webhook.objects.create(client=owner, url="https://example.com/h", events=["*"],
                                  secret_salt="s")  # fmt: skip
    until = timezone.now() + timedelta(minutes=5)
    Webhook.objects.filter(pk=hook.pk).update(circuit_state="open", circuit_failures=7,
                                              circuit_open_until=until)  # fmt: skip
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    shown = api.get(f"/api/v1/webhooks/{hook.pk}/").json()["circuit"]
    assert shown["state"] == "open" and shown["failures"] == 7
    assert shown["open_until"].startswith(until.strftime("%Y-%m-%dT%H:%M"))
    client.force_login(make_staff("staff", "view_webhook"))
    page = client.get(reverse("admin:jobs_webhook_changelist")).content.decode()
    assert "open until" in page and "after 7 failures" in page
    Webhook.objects.filter(pk=hook.pk).update(
        circuit_state=CircuitState.CLOSED, circuit_failures=0, circuit_open_until=None
    )
    listed = api.get("/api/v1/webhooks/").json()[0]["circuit"]
    assert listed == {"state": "closed", "failures": 0, "open_until": None}


# --- runworker's split -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "queues,main,own",
    [
        ("default,webhooks", ["default"], True),
        ("*", [], True),
        ("high:5,*", ["high"], True),
        ("webhooks", ["webhooks"], False),
        ("default", ["default"], False),
    ],
)
def test_runworker_gives_deliveries_their_own_worker(queues, main, own):
    spec, split = deliveries.split(parse_queues(queues))
    assert (list(spec.weights), split) == (main, own)
    if split:  # nor does `*` bring the deliveries back to the main worker
        assert "webhooks" not in spec.with_queues(["webhooks", "other"])
