"""Traces, error reports and log fields around jobs (jobs.observability, issue 44), in
this process: an SDK tracer provider with an in-memory exporter (never the global one,
so other tests stay untraced), a real Sentry client posting to a fake DSN endpoint on
127.0.0.1, and `run_jobs` as the worker. The subprocess chain is in
tests/test_observability_e2e.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import tests.observability_tasks  # noqa: F401 - registers the tasks
from harness import ROOT
from harness.telemetry import SentryReceiver
from jobs import submission
from jobs.models import Job, Schedule
from jobs.observability import hooks, tracing
from jobs.observability.logs import JobContextFilter
from jobs.schedules import define, firing
from jobs.testing import run_jobs
from tests.harness import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def spans(settings):
    settings.JOBS_RETRY_BACKOFF_BASE = 0  # a retry is due at once: run_jobs runs it
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    yield exporter
    tracing.use_provider(None)
    provider.shutdown()


@pytest.fixture
def sentry(settings):
    import sentry_sdk

    settings.JOBS_RETRY_BACKOFF_BASE = 0
    receiver = SentryReceiver()
    sentry_sdk.init(dsn=receiver.dsn, default_integrations=False)
    yield receiver
    sentry_sdk.flush(5)
    sentry_sdk.get_client().close()
    sentry_sdk.get_global_scope().set_client(None)
    receiver.close()


def named(exporter: InMemorySpanExporter, name: str) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_a_job_submitted_in_a_span_is_one_trace_to_its_retry_and_step(spans):
    with tracing.tracer().start_as_current_span("POST /api/v1/jobs/") as request:
        job, _ = submission.submit("obs.step_then_retry", {"amount": 3})
    ran = run_jobs()
    assert [r.status for r in ran] == ["queued", "done"]

    (send,) = named(spans, "send default")
    trace_id = request.get_span_context().trace_id
    assert send.kind == SpanKind.PRODUCER
    assert send.parent.span_id == request.get_span_context().span_id
    assert send.attributes["messaging.operation.type"] == "send"
    assert send.attributes["messaging.destination.name"] == "default"
    assert send.attributes["messaging.message.id"] == str(job.pk)
    # The job stores the producer span's context, bounded (D300).
    stored = Job.objects.get(pk=job.pk).trace_context
    assert stored.startswith(f"00-{trace_id:032x}-{send.context.span_id:016x}-")

    first, second = sorted(named(spans, "process default"), key=lambda s: s.start_time)
    for attempt, span in enumerate((first, second), start=1):
        assert span.kind == SpanKind.CONSUMER
        assert span.context.trace_id == trace_id
        assert span.parent.span_id == send.context.span_id  # one job is one message
        assert [link.context.span_id for link in span.links] == [send.context.span_id]
        assert span.attributes["messaging.operation.type"] == "process"
        assert span.attributes["messaging.message.id"] == str(job.pk)
        assert span.attributes["jobservice.attempt"] == attempt
        assert span.attributes["jobservice.fence"] == "held"
    assert first.status.status_code == StatusCode.ERROR
    assert first.attributes["error.type"] == "tests.observability_tasks.CardDeclined"
    assert first.attributes["jobservice.retry"] is True
    assert first.attributes["jobservice.status"] == "queued"
    assert second.attributes["jobservice.status"] == "done"
    assert second.status.status_code != StatusCode.ERROR
    # The step ran once, in the first attempt; the second read its checkpoint.
    (step,) = named(spans, "step charge")
    assert step.parent.span_id == first.context.span_id


def test_a_schedules_jobs_are_traces_of_their_own_linked_to_its_creation(spans):
    """A firing months later is not a child of the request that made the schedule: the
    conventions' link to the creation context (D306)."""
    with tracing.tracer().start_as_current_span("POST /api/v1/schedules/") as request:
        schedule = define.create(
            {"name": "nightly", "interval_seconds": 60, "task": "echo", "payload": {}},
            client=None, origin=Schedule.Origin.ADMIN,
        )  # fmt: skip
    fired = firing.run_now(schedule.pk, "staff:test")
    run_jobs()
    (span,) = named(spans, "process default")
    assert span.parent is None
    created = request.get_span_context()
    assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [
        (created.trace_id, created.span_id)
    ]
    assert span.attributes["messaging.message.id"] == str(fired.job_id)
    assert hooks.record_headers(Job.objects.get(pk=fired.job_id).trace_context) == []


def test_a_stale_write_is_an_event_on_the_attempts_span_and_reports_nothing(spans, sentry):
    job, _ = submission.submit("obs.stale_failure", {})
    run_jobs(until_empty=False)
    (span,) = named(spans, "process default")
    assert span.attributes["jobservice.fence"] == "rejected"
    assert [e.name for e in span.events if e.name.startswith("jobservice")] == [
        "jobservice.stale_write"
    ]
    # Submitted outside any trace: the producer span is the trace's root.
    (send,) = named(spans, "send default")
    assert send.parent is None and span.parent.span_id == send.context.span_id
    assert Job.objects.get(pk=job.pk).trace_context is not None
    import sentry_sdk

    sentry_sdk.flush(5)
    assert sentry.received() == []


def test_each_failed_attempt_reaches_sentry_once_with_the_job_as_tags(sentry):
    job, _ = submission.submit("obs.always_fails", {}, max_retries=1)
    ran = run_jobs()
    assert [r.status for r in ran] == ["queued", "failed"]
    wait_until(lambda: len(sentry.received()) >= 2, 10, "two events at the fake DSN")
    events = sorted(sentry.received(), key=lambda e: e["tags"]["attempt"])
    assert len(events) == 2
    # The retry's requeue and its claim each bump the lease.
    assert [e["tags"]["lease_version"] for e in events] == [1, 3]
    for attempt, event in enumerate(events, start=1):
        tags = event["tags"]
        assert tags["job_id"] == job.pk and tags["task"] == "obs.always_fails"
        assert tags["queue"] == "default" and tags["attempt"] == attempt
        (exc,) = event["exception"]["values"]
        assert exc["type"] == "CardDeclined"
        assert exc["value"] == f"declined on attempt {attempt}"
    # The first will run again: handled. The last is the job's failure.
    assert [e["exception"]["values"][0]["mechanism"]["handled"] for e in events] == [True, False]
    assert [e["level"] for e in events] == ["warning", "error"]


def test_without_an_sdk_nothing_is_traced_and_a_requests_traceparent_passes_through():
    assert tracing.tracer() is None
    job, _ = submission.submit("echo", {})
    assert Job.objects.get(pk=job.pk).trace_context is None
    token = tracing.incoming(PARENT, "congo=t61rcWkgMzE")
    try:
        job, _ = submission.submit("echo", {})
    finally:
        tracing.release(token)
    stored = Job.objects.get(pk=job.pk).trace_context
    assert stored == f"{PARENT}\ncongo=t61rcWkgMzE"
    assert hooks.record_headers(stored) == [
        ("traceparent", PARENT.encode()), ("tracestate", b"congo=t61rcWkgMzE")
    ]  # fmt: skip


@pytest.mark.parametrize(
    "carrier, stored",
    [
        ({"traceparent": PARENT}, PARENT),
        ({"traceparent": PARENT.upper()}, PARENT),
        ({"traceparent": "not-a-traceparent"}, None),
        ({"traceparent": "ff" + PARENT[2:]}, None),  # version ff is invalid
        ({}, None),
        # A tracestate past 512 characters is cut at an entry; one with a newline dropped.
        ({"traceparent": PARENT, "tracestate": ",".join(["k=" + "v" * 60] * 10)},
         PARENT + "\n" + ",".join(["k=" + "v" * 60] * 8)),
        ({"traceparent": PARENT, "tracestate": "a=1\nb=2"}, PARENT),
    ],
)  # fmt: skip
def test_the_stored_context_is_a_valid_traceparent_and_a_bounded_tracestate(carrier, stored):
    assert tracing.encode(carrier) == stored
    assert stored is None or len(stored) <= tracing.MAX_STORED


def test_log_lines_carry_the_trace_and_the_running_job(spans, caplog):
    handler_filter = JobContextFilter()
    caplog.handler.addFilter(handler_filter)
    try:
        with caplog.at_level(logging.WARNING, logger="tests.observability"):
            with tracing.tracer().start_as_current_span("request"):
                job, _ = submission.submit("obs.step_then_retry", {})
            run_jobs()
    finally:
        caplog.handler.removeFilter(handler_filter)
    lines = [r for r in caplog.records if r.getMessage() == "charging in the handler"]
    assert len(lines) == 2
    processes = sorted(named(spans, "process default"), key=lambda s: s.start_time)
    for record, span in zip(lines, processes, strict=True):
        assert (record.job_id, record.task) == (job.pk, "obs.step_then_retry")
        assert record.trace_id == f"{span.context.trace_id:032x}"
        assert record.span_id == f"{span.context.span_id:016x}"


def test_redis_py_metrics_still_reach_an_applications_meter_provider():
    """A host that sets up a MeterProvider and turns redis-py's own metrics on gets them
    from the transport's client (D374 left redis-py's import as it is). In a process of
    its own: the global provider can be set once."""
    code = textwrap.dedent(
        """
        import sys
        import django
        django.setup()
        from jobs.transport import get_transport
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from redis.observability import OTelConfig, get_observability_instance
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        get_observability_instance().init(OTelConfig())
        transport = get_transport()
        assert transport.enabled
        transport._client.ping()
        names = {m.name for rm in reader.get_metrics_data().resource_metrics
                 for sm in rm.scope_metrics for m in sm.metrics}
        print("metrics:", sorted(names))
        """
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "jobservice.test_settings"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "db.client.connection.create_time" in done.stdout, done.stdout
