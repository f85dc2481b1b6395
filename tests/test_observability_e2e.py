"""One trace from a REST request to the webhook and the Kafka record (issue 44), with real
processes: the API server, runworker and runreaper export their spans over OTLP/HTTP
(the `otel` extra, configured by OTEL_* variables only) to a receiver this test starts
on 127.0.0.1; a webhook receiver and a Kafka-protocol broker record what goes out; a
fake Sentry DSN endpoint records the worker's error reports."""

from __future__ import annotations

import http.client
import io
import json
import threading
from http.server import BaseHTTPRequestHandler

import pytest
from django.core.management import call_command

import tests.observability_tasks  # noqa: F401 - registers the tasks submitted here
from harness.receiver import serve_on_loopback
from harness.telemetry import OtlpReceiver, SentryReceiver
from jobs import submission
from jobs.events import signing
from jobs.models import Client, Job, Webhook
from tests.harness import free_port, wait_until

pytestmark = pytest.mark.slow

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"
SERVER, PRODUCER, CONSUMER, CLIENT = 2, 4, 5, 3  # OTLP's Span.SpanKind
TASKS = "demo.tasks,tests.observability_tasks"
QUICK = {
    "JOBS_TASK_MODULES": TASKS,
    "JOBS_RETRY_BACKOFF_BASE": "0.05",
    "JOBS_RETRY_BACKOFF_MAX": "0.2",
    "JOBS_OUTBOX_INTERVAL": "0.1",
    "JOBS_WEBHOOK_ALLOW_PRIVATE": "1",
}


def otel_env(receiver: OtlpReceiver, service: str) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within a tenth of a second
        "OTEL_SERVICE_NAME": service,
        **QUICK,
    }


class HookReceiver:
    """Answers 200 and keeps each request's `traceparent` header."""

    def __init__(self) -> None:
        self.traceparents: list[str | None] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                with receiver.lock:
                    receiver.traceparents.append(self.headers.get("traceparent"))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server, self.url = serve_on_loopback(Handler)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def otlp():
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


def post_job(port: int, token: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/api/v1/jobs/", json.dumps(body), {
            "Authorization": f"Token {token}", "Content-Type": "application/json",
            "traceparent": TRACEPARENT, "tracestate": "vendor=opaque",
        })  # fmt: skip
        response = conn.getresponse()
        assert response.status == 201, response.read()
        return json.loads(response.read())
    finally:
        conn.close()


def test_a_rest_submission_is_one_trace_to_its_retry_step_webhook_and_kafka_record(
    stack, broker, otlp, request
):
    topic = f"jobs.events.{request.node.name[:40]}"
    broker.create_topic(topic, partitions=1)
    call_command("outbox", "start", "kafka", "kafka.domain", "--from", "now",
                 stdout=io.StringIO())  # fmt: skip
    client, token = Client.create_with_token("traced")
    hook = HookReceiver()
    salt = signing.new_salt()
    Webhook.objects.create(client=client, url=hook.url, events=[signing.event_type("done")],
                           secret_salt=salt)  # fmt: skip
    try:
        stack.reaper("--interval", "1", JOBS_KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap,
                     JOBS_KAFKA_TOPIC=topic, **otel_env(otlp, "reaper"))  # fmt: skip
        stack.worker("--concurrency", "2", **otel_env(otlp, "worker"))
        port = free_port()
        stack.api(port, **otel_env(otlp, "api"))
        job = post_job(port, token, {"task": "obs.step_then_retry", "payload": {"amount": 5}})
        wait_until(lambda: Job.objects.get(pk=job["id"]).status == "done", 30, "the job done")
        wait_until(lambda: hook.traceparents, 30, "the job.done webhook")

        def spans_of_the_trace() -> list:
            return [s for s in otlp.received() if s.trace_id == TRACE_ID]

        wait_until(lambda: {"POST", "process webhooks"} <= {s.name for s in spans_of_the_trace()},
                   30, "the webhook call's and its delivery's spans exported")  # fmt: skip
        spans = spans_of_the_trace()
        (server,) = [s for s in spans if s.kind == SERVER]
        assert server.parent_id == PARENT_SPAN and server.service == "api"
        (send,) = [s for s in spans if s.kind == PRODUCER]
        assert send.name == "send default" and send.parent_id == server.span_id
        assert send.attributes["messaging.message.id"] == str(job["id"])
        attempts = sorted(
            (s for s in spans if s.kind == CONSUMER and s.attributes.get(
                "messaging.message.id") == str(job["id"])),
            key=lambda s: s.attributes["jobservice.attempt"],
        )  # fmt: skip
        assert [s.attributes["jobservice.attempt"] for s in attempts] == [1, 2]
        for span in attempts:
            assert span.name == "process default" and span.service == "worker"
            assert span.parent_id == send.span_id
            assert span.links == [(TRACE_ID, send.span_id)]
        assert attempts[0].attributes["jobservice.retry"] is True
        assert attempts[0].attributes["error.type"] == "tests.observability_tasks.CardDeclined"
        assert attempts[1].attributes["jobservice.status"] == "done"
        (step,) = [s for s in spans if s.name == "step charge"]
        assert step.parent_id == attempts[0].span_id
        # The delivery job goes on in the trace; its call carries the client span's context.
        (call,) = [s for s in spans if s.kind == CLIENT]
        delivery = next(s for s in spans if s.span_id == call.parent_id)
        assert delivery.name == "process webhooks" and delivery.parent_id == send.span_id
        assert hook.traceparents[0].startswith(f"00-{TRACE_ID}-{call.span_id}-")
        # The Kafka record of the job's completion carries the job's trace context.
        done = [m for m in broker.read(topic, expect=1) if m.job_id == job["id"]
                and m.type == "job.done"]  # fmt: skip
        assert done, "no job.done record on the topic"
        assert done[0].headers["traceparent"].startswith(f"00-{TRACE_ID}-{send.span_id}-")
    finally:
        hook.close()


def test_each_failed_attempt_reaches_sentry_once_from_a_real_worker(stack):
    """SENTRY_DSN is all the worker needs (jobservice's settings start the client)."""
    sentry = SentryReceiver()
    try:
        stack.worker("--concurrency", "1", SENTRY_DSN=sentry.dsn, **QUICK)
        job, _ = submission.submit("obs.always_fails", {}, max_retries=1)
        wait_until(lambda: Job.objects.get(pk=job.pk).status == "failed", 30, "the job failed")
        wait_until(lambda: len(sentry.received()) >= 2, 30, "two reports")
        events = sorted(sentry.received(), key=lambda e: e["tags"]["attempt"])
        assert len(events) == 2
        assert [(e["tags"]["job_id"], e["tags"]["task"], e["tags"]["queue"]) for e in events] == [
            (job.pk, "obs.always_fails", "default")] * 2  # fmt: skip
        assert [e["exception"]["values"][0]["mechanism"]["handled"] for e in events] == [
            True, False]  # fmt: skip
    finally:
        sentry.close()
