"""An endpoint's deliveries in runs (issue 41), against real PostgreSQL and a real receiver
on 127.0.0.1: a fast endpoint's due deliveries go out on the slot of the first one, a
batch a time, each job completed under its own fence; a failure in a run is retried like
any (Retry-After kept), counted by the circuit and ends the run with the rest released
unspent; a slow endpoint gets no run. And the fan-out: a batch's delivery rows and
their jobs in one statement, one job per chain."""

from __future__ import annotations

import json

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from harness.receiver import Recording
from jobs import services
from jobs.events import backlog, batches, endpoints, signing
from jobs.events.outbox import Dispatcher
from jobs.events.reads import Built, binary_rows
from jobs.events.relay import FANOUT_HISTORY, WebhookFanout
from jobs.events.sources import HISTORY
from jobs.events.webhooks import deliver
from jobs.lifecycle import Status
from jobs.models import Client, Job, JobEvent, Webhook, WebhookDelivery
from jobs.tasks import JobContext
from jobs.transport import get_transport

pytestmark = pytest.mark.django_db(transaction=True)

N = 12


class Recorder:
    """A subscriber like the stream: each event's body, by event id."""

    name = "recorder"
    starts_at_beginning = True

    def __init__(self) -> None:
        self.bodies: dict[int, str] = {}

    def handle(self, events) -> int:
        self.bodies.update((e.id, e.body) for e in events)
        return len(events)


@pytest.fixture
def receiver(request):
    found = Recording(fail_calls=getattr(request, "param", ()), retry_after="30")
    yield found
    found.close()


@pytest.fixture
def hook(receiver, settings):
    settings.JOBS_WEBHOOK_ALLOW_PRIVATE = True
    settings.JOBS_RETRY_BACKOFF_BASE = 0
    owner = Client.objects.create(name="runs", token_hash="r" * 64)
    yield Webhook.objects.create(client=owner, url=receiver.url, events=["job.done"],
                                 secret_salt=signing.new_salt())  # fmt: skip
    endpoints.SLOTS.close()


def deliveries_queued(hook: Webhook, n: int = N) -> list[int]:
    """n jobs of the hook's client done, and the outbox's delivery jobs for them."""
    fanout = Dispatcher([WebhookFanout()])
    fanout.tick()
    items = [services.NewJob("echo", {"n": i}) for i in range(n)]
    sources = [s.job_id for s in services.submit_many(items, client_id=hook.client_id)]
    for job_id in sources:
        services.complete([(services.claim("w1", job_id), {"n": job_id})])
    for _ in range(3):
        fanout.tick()
    jobs = list(WebhookDelivery.objects.exclude(job_id=None).values_list("job_id", flat=True))
    assert len(jobs) == n
    return jobs


def attempt(job_id: int) -> dict:
    """One delivery job's attempt as a delivery worker runs it: claimed, its handler
    called, its result written back under its fence."""
    (lease,) = services.claim_ids("deliveries-1", [job_id], start=1)
    ctx = JobContext(lease.job_id, lease.lease_version, 1, lease.worker_id,
                     signing.WEBHOOK_QUEUE, signing.DELIVER_TASK)  # fmt: skip
    result = deliver(lease.payload, ctx)
    assert services.complete([(lease, result)])
    return result


def parks(jobs: list[int]) -> int:
    return JobEvent.objects.filter(job_id__in=jobs, from_status=Status.PROCESSING,
                                   to_status=Status.QUEUED).count()  # fmt: skip


def test_a_fast_endpoints_deliveries_go_out_in_the_first_ones_run(hook, receiver, monkeypatch):
    # What "fast" and the run's length are is the bench's question; here, that a run
    # takes the others: a loaded machine's 50 ms call must not end it.
    monkeypatch.setattr(batches, "FAST_SECONDS", 2.0)
    monkeypatch.setattr(batches, "RUN_SECONDS", 30.0)
    jobs = deliveries_queued(hook)
    assert attempt(jobs[0])["run"] == N - 1  # its run took the other eleven
    assert len(receiver.calls) == N
    assert len({c[0] for c in receiver.calls}) == N  # one webhook-id per event
    assert Job.objects.filter(pk__in=jobs, status=Status.DONE).count() == N
    assert sorted(WebhookDelivery.objects.values_list("attempts", flat=True)) == [1] * N
    assert set(WebhookDelivery.objects.values_list("last_status_code", flat=True)) == {200}
    assert parks(jobs) == 0
    # Each delivery job: queued, processing (its attempt marked started), done.
    for job in Job.objects.filter(pk__in=jobs):
        assert job.started_at is not None and job.retry_count == 0
    hook.refresh_from_db()
    assert (hook.circuit_state, hook.circuit_failures) == ("closed", 0)


def test_a_run_ends_at_once_while_the_outbox_is_far_behind(hook, receiver, monkeypatch):
    """D409: a delivery still makes its own call, but takes none of its endpoint's other
    deliveries while a reaper says the outbox is a batch behind; once it is not, the
    next delivery's run takes the rest."""
    monkeypatch.setattr(batches, "FAST_SECONDS", 2.0)
    monkeypatch.setattr(batches, "RUN_SECONDS", 30.0)
    jobs = deliveries_queued(hook)
    transport = get_transport()
    transport.set_flag(backlog.FLAG, 30_000)
    monkeypatch.setattr(backlog, "HOLD", backlog.Hold())
    try:
        assert attempt(jobs[0])["run"] == 0
    finally:
        transport.clear_flag(backlog.FLAG)
    assert len(receiver.calls) == 1
    assert Job.objects.filter(pk__in=jobs, status=Status.QUEUED).count() == N - 1
    monkeypatch.setattr(backlog, "HOLD", backlog.Hold())
    assert attempt(jobs[1])["run"] == N - 2
    assert len(receiver.calls) == N


@pytest.mark.parametrize("receiver", [{4}], indirect=True)
def test_a_failure_ends_the_run_is_retried_and_the_rest_go_back_unspent(hook, receiver):
    jobs = deliveries_queued(hook)
    assert attempt(jobs[0])["run"] == 3  # calls 2, 3 and the failed 4th
    assert len(receiver.calls) == 4
    failed_job = WebhookDelivery.objects.get(last_status_code=500).job
    # Retried like any failed attempt: a retry spent, held back by its Retry-After.
    assert failed_job.status == Status.QUEUED and failed_job.retry_count == 1
    assert "answered HTTP 500" in failed_job.error
    assert (failed_job.run_at - failed_job.updated_at).total_seconds() >= 25
    hook.refresh_from_db()
    assert hook.circuit_failures == 1  # counted by the breaker, under that job's fence
    done = Job.objects.filter(pk__in=jobs, status=Status.DONE).count()
    assert done == 3
    # Not called: queued again, no retry spent, no attempt counted.
    rest = Job.objects.filter(pk__in=jobs, status=Status.QUEUED).exclude(pk=failed_job.pk)
    assert rest.count() == N - 4
    assert all(j.retry_count == 0 and j.webhook_delivery.attempts == 0 for j in rest)
    # The next run delivers them; the first answer resets the breaker's count.
    assert attempt(rest.first().pk)["run"] == N - 5
    hook.refresh_from_db()
    assert hook.circuit_failures == 0
    assert Job.objects.filter(pk__in=jobs, status=Status.DONE).count() == N - 1
    assert len({c[0] for c in receiver.calls}) == N


def test_a_slow_answer_gets_no_run(hook, receiver, monkeypatch):
    monkeypatch.setattr(batches, "FAST_SECONDS", 0.0)  # every answer counts as slow
    jobs = deliveries_queued(hook, 3)
    assert all("run" not in attempt(j) for j in jobs)
    assert Job.objects.filter(pk__in=jobs, status=Status.DONE).count() == 3


def test_the_fan_out_writes_rows_and_jobs_in_one_statement_one_job_per_chain(hook):
    Webhook.objects.filter(pk=hook.pk).update(events=["*"])
    fanout = WebhookFanout()
    items = [services.NewJob("echo", {"n": i}) for i in range(5)]
    sources = [s.job_id for s in services.submit_many(items, client_id=hook.client_id)]
    for job_id in sources:
        services.complete([(services.claim("w1", job_id), {})])
    # Read as the reaper's fan-out reads them: narrow rows, whole ones for its webhooks'.
    with connection.cursor() as cur:
        cur.execute(FANOUT_HISTORY.events_sql, [0, 1 << 62, 1000])
        events = [FANOUT_HISTORY.event(r) for r in cur.fetchall()]
    # The whole rows as the stream and Kafka read them (binary: JSON parsed).
    bodies = {
        e.id: e.body
        for e in map(HISTORY.event, binary_rows(HISTORY.events_sql, [0, 1 << 62, 1000]))
    }
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        assert fanout.handle(events) == 15  # queued, processing, done of five jobs
    writes = [q["sql"] for q in queries if "INSERT" in q["sql"] or "UPDATE" in q["sql"]]
    assert len(writes) == 1
    # Each chain (webhook, job) has a job for its first event only, in seq order.
    heads = WebhookDelivery.objects.exclude(job_id=None)
    assert sorted(heads.values_list("source_job_id", "seq")) == [(j, 1) for j in sources]
    assert WebhookDelivery.objects.filter(job_id=None).count() == 10
    assert Job.objects.filter(task=signing.DELIVER_TASK, status=Status.QUEUED).count() == 5
    assert {d.event_id: d.body for d in WebhookDelivery.objects.all()} == bodies
    # The job's JSON as JSON, not as a string of it (a text read of the rows gave that).
    first = json.loads(WebhookDelivery.objects.order_by("id").first().body)["data"]
    assert first["payload"] == {"n": 0} and first["result"] == {}
    # The batch again (a dispatcher killed before its cursor moved): nothing new.
    with transaction.atomic():
        fanout.handle(events)
    assert WebhookDelivery.objects.count() == 15
    assert Job.objects.filter(task=signing.DELIVER_TASK).count() == 5


def _one_done_job(hook: Webhook, trace_context: str | None = None) -> int:
    """A job of the hook's client, done (with `trace_context`, as a traced request sets it)."""
    (source,) = [s.job_id for s in services.submit_many([services.NewJob("echo", {})],
                                                           client_id=hook.client_id)]  # fmt: skip
    if trace_context is not None:
        Job.objects.filter(pk=source).update(trace_context=trace_context)
    services.complete([(services.claim("w1", source), {})])
    return source


def _narrow_after(after: int) -> list:
    with connection.cursor() as cur:
        cur.execute(FANOUT_HISTORY.events_sql, [after, 1 << 62, 1000])
        return [FANOUT_HISTORY.event(r) for r in cur.fetchall()]


def test_only_a_delivery_jobs_end_makes_the_fan_out_look_at_its_chain(hook):
    """A chain (webhook, source job) gets its next delivery's job when the one before
    ends; the delivery job's queued and processing events leave it busy, so a batch of
    those costs the fan-out no statement, and its done event releases the next in seq
    order (issue 41: they were two thirds of the chains the fan-out checked)."""
    Webhook.objects.filter(pk=hook.pk).update(events=["*"])
    fanout = WebhookFanout()
    _one_done_job(hook)
    with transaction.atomic():
        assert fanout.handle(_narrow_after(0)) == 3  # queued, processing, done
    head = WebhookDelivery.objects.get(job__isnull=False)
    assert head.seq == 1
    seen = JobEvent.objects.order_by("-id").values_list("id", flat=True).first()
    lease = services.claim("deliveries-1", head.job_id)
    busy = _narrow_after(seen)  # the delivery job's processing event
    assert [(e.job_id, e.to_status) for e in busy] == [(head.job_id, Status.PROCESSING)]
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        assert fanout.handle(busy) == 0
    assert [q["sql"] for q in queries] == []
    assert WebhookDelivery.objects.exclude(job_id=None).count() == 1
    seen = busy[-1].id
    assert services.complete([(lease, {"status": 200})])
    with transaction.atomic():
        fanout.handle(_narrow_after(seen))  # its done event: the chain is idle again
    released = WebhookDelivery.objects.exclude(job_id=None).exclude(pk=head.pk).get()
    assert released.seq == 2
    assert released.job.status == Status.QUEUED


def test_a_delivery_job_goes_on_in_its_source_jobs_trace_new_or_waiting(hook):
    """D303: a delivery job carries its source job's trace context, whether it is given
    with its row (the batch's event carries the context) or later to a waiting row (read
    from the source job then)."""
    Webhook.objects.filter(pk=hook.pk).update(events=["*"])
    fanout = WebhookFanout()
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    _one_done_job(hook, traceparent)
    with transaction.atomic():
        fanout.handle(_narrow_after(0))  # the first delivery's job, with its row
    head = WebhookDelivery.objects.get(job__isnull=False)
    assert head.job.trace_context == traceparent
    seen = JobEvent.objects.order_by("-id").values_list("id", flat=True).first()
    services.complete([(services.claim("deliveries-1", head.job_id), {"status": 200})])
    with transaction.atomic():
        fanout.handle(_narrow_after(seen))  # the next, a waiting row, when the first ends
    (second,) = WebhookDelivery.objects.exclude(job_id=None).exclude(pk=head.pk)
    assert second.seq == 2 and second.job.trace_context == traceparent


def test_the_fan_out_takes_its_range_from_the_streams_window(hook):
    """Sharing the reaper's window (D394): once the stream has read a range, the fan-out
    takes its events from there (whole rows: no read of its own, narrow or whole), and
    writes each delivery's body as the stream has it; its narrow rows never enter the
    window, and a range the window does not hold is read as before."""
    Webhook.objects.filter(pk=hook.pk).update(events=["*"])
    built = Built(keep=100)
    stream = Recorder()
    reader = Dispatcher([stream], batch=50, built=built)
    fanout = Dispatcher([WebhookFanout()], batch=50, sources=(FANOUT_HISTORY,), built=built)
    for d in (reader, fanout):
        d.tick()  # the cursors' first horizons
    items = [services.NewJob("echo", {"n": i}) for i in range(4)]
    sources = [s.job_id for s in services.submit_many(items, client_id=hook.client_id)]
    for job_id in sources:
        services.complete([(services.claim("w1", job_id), {"n": job_id})])
    for _ in range(3):
        reader.tick()
    assert len(stream.bodies) == 12  # queued, processing, done of four jobs
    hits = built.hits
    with CaptureQueriesContext(connection) as queries:
        for _ in range(2):  # a horizon past the twelve, then their tick
            fanout.tick()
    assert built.hits - hits == 12
    assert not [q for q in queries if "FROM jobs_jobevent e" in q["sql"]]
    assert {d.event_id: d.body for d in WebhookDelivery.objects.all()} == stream.bodies
    assert all(e.row is not None for e in built._windows["jobs_jobevent"][2])
    # Further jobs the stream has not read yet: the fan-out reads them itself.
    for job_id in [s.job_id for s in services.submit_many(items, client_id=hook.client_id)]:
        services.complete([(services.claim("w1", job_id), {})])
    for _ in range(3):
        fanout.tick()
    assert WebhookDelivery.objects.count() == 24


def test_the_fan_out_first_to_a_range_reads_it_whole_for_the_stream(hook):
    """With the stream or Kafka sharing the window (D397), the fan-out that reaches a range
    first reads its whole rows into the window: the stream then reads no row itself and
    gets each event once, in order, with the body the deliveries carry. Without a lead
    (no other sink) the fan-out reads narrow rows and leaves the window empty."""
    Webhook.objects.filter(pk=hook.pk).update(events=["*"])
    built = Built(keep=100, lead=True)
    stream = Recorder()
    reader = Dispatcher([stream], batch=50, built=built)
    fanout = Dispatcher([WebhookFanout()], batch=50, sources=(FANOUT_HISTORY,), built=built)
    alone = Built(keep=100)
    solo = Dispatcher([WebhookFanout()], batch=50, sources=(FANOUT_HISTORY,), built=alone)
    solo.subscribers[0].name = "webhooks-alone"  # a cursor of its own, from the beginning
    for d in (fanout, reader, solo):
        d.tick()  # the cursors' first horizons
    items = [services.NewJob("echo", {"n": i}) for i in range(4)]
    for job_id in [s.job_id for s in services.submit_many(items, client_id=hook.client_id)]:
        services.complete([(services.claim("w1", job_id), {"n": job_id})])
    for _ in range(2):  # a horizon past the twelve, then their tick
        fanout.tick()
    assert WebhookDelivery.objects.count() == 12
    hits = built.hits
    with CaptureQueriesContext(connection) as queries:
        for _ in range(3):
            reader.tick()
    assert not [q for q in queries if "FROM jobs_jobevent e" in q["sql"]]
    assert built.hits - hits == 12
    expected = list(
        JobEvent.objects.filter(kind="transition").order_by("id").values_list("id", flat=True)
    )
    assert list(stream.bodies) == expected
    assert {d.event_id: d.body for d in WebhookDelivery.objects.all()} == {
        i: b for i, b in stream.bodies.items() if i in set(
            WebhookDelivery.objects.values_list("event_id", flat=True))
    }  # fmt: skip
    for _ in range(2):
        solo.tick()
    assert alone._windows == {}  # read narrow: nothing for others to follow
