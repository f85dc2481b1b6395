"""A fast endpoint's deliveries flow without parking (issue 41), end to end: two default
`runworker`s (4 delivery threads each, 2 slots per endpoint) and a `runreaper` as
subprocesses, a real receiver on 127.0.0.1 that answers 200 at once.

Before, a delivery that found its endpoint's two slots busy parked for 0.5-1.5 s (half
of them or more here); now it waits the milliseconds a fast call takes for a slot its
process holds. The bound still holds: the receiver never sees more than 2 calls at once.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from harness.receiver import serve_on_loopback
from jobs import services
from jobs.events import signing
from jobs.lifecycle import Status
from jobs.models import Client, JobEvent, Webhook, WebhookDelivery
from tests.harness import wait_until
from tests.test_webhooks_e2e import dispatcher_started

pytestmark = pytest.mark.slow

JOBS = 300
ENV = {"JOBS_WEBHOOK_ALLOW_PRIVATE": "1", "JOBS_OUTBOX_INTERVAL": "0.1"}


class Counting:
    """Answers 200 at once (HTTP/1.1, kept alive); notes the most calls open at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = self.most = self.calls = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def do_POST(self):
                with receiver.lock:
                    receiver.open += 1
                    receiver.calls += 1
                    receiver.most = max(receiver.most, receiver.open)
                self.rfile.read(int(self.headers["content-length"]))
                time.sleep(0.002)  # long enough for two calls to overlap if allowed
                with receiver.lock:
                    receiver.open -= 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server, self.url = serve_on_loopback(Handler)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_fast_endpoint_gets_its_deliveries_without_parks_within_its_slots(stack):
    owner = Client.objects.create(name="fast", token_hash="q" * 64)
    stack.reaper("--interval", "1", **ENV)
    wait_until(dispatcher_started, 30, "the dispatcher's first tick")
    receiver = Counting()
    Webhook.objects.create(client=owner, url=receiver.url, events=["job.done"],
                           secret_salt=signing.new_salt())  # fmt: skip
    try:
        for _ in range(2):
            stack.worker(ready=True, **ENV)
        items = [services.NewJob("echo", {"n": i}) for i in range(JOBS)]
        services.submit_many(items, client_id=owner.pk)
        wait_until(
            lambda: WebhookDelivery.objects.filter(job__status=Status.DONE).count() == JOBS,
            120, "every delivery done", interval=0.2,
        )  # fmt: skip
        jobs = list(WebhookDelivery.objects.values_list("job_id", flat=True))
        parks = JobEvent.objects.filter(job_id__in=jobs, from_status=Status.PROCESSING,
                                        to_status=Status.QUEUED).count()  # fmt: skip
        print(f"{JOBS} deliveries: {parks} parks, {receiver.calls} calls, "
              f"at most {receiver.most} at once")  # fmt: skip
        assert receiver.calls == JOBS
        assert receiver.most <= 2  # JOBS_WEBHOOK_ENDPOINT_CONCURRENCY
        # Parks come while the two processes share the endpoint's slots out and while the
        # other process's run holds them (D260, D261): 12-50 of 300 seen on a quiet
        # machine, 99 at load 7; before slots were held per process, half or more parked.
        assert parks < JOBS * 2 // 5
    finally:
        receiver.close()
