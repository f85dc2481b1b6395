"""Tenants (issue 28 item 1): a client submits public tasks only, an internal name answers
exactly like a name that does not exist, and no client can cause a write to another
client's rows through any task (a real receiver on 127.0.0.1, a real worker)."""

from __future__ import annotations

import json

import pytest
from django.apps import apps
from django.db import models

from jobs import tasks
from jobs.events import signing, subscriber
from jobs.events.outbox import Dispatcher
from jobs.events.relay import WebhookFanout
from jobs.models import Client, Job, WebhookDelivery
from jobs.worker import Worker
from tests.api.conftest import counts
from tests.test_webhook_delivery import Server

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs/"
INTERNAL = "tenants.internal"


@tasks.task(INTERNAL, public=False)
def _internal(payload, ctx):
    return payload


@subscriber("tenants.event", name="tenants.subscriber")
def _subscriber(event, ctx):
    return event


def post(api, url, body):
    return api.post(url, data=json.dumps(body), content_type="application/json")


def internal_names() -> list[str]:
    return [n for n in tasks.names() if not tasks.is_public(n)]


def test_the_built_in_internal_tasks_are_internal():
    assert {signing.DELIVER_TASK, INTERNAL, "event:tenants.subscriber"} <= set(internal_names())
    assert {"echo", "sleep", "fail"} <= set(tasks.public_names())


@pytest.mark.parametrize("name", [signing.DELIVER_TASK, INTERNAL, "event:tenants.subscriber"])
def test_an_internal_name_answers_exactly_like_a_missing_one(api, name):
    before = counts()
    r = post(api, JOBS, {"task": name, "payload": {"delivery_id": 1}})
    missing = post(api, JOBS, {"task": "no-such-task", "payload": {"delivery_id": 1}})
    assert r.status_code == missing.status_code == 400
    assert r.json()["code"] == missing.json()["code"] == "unknown_task"
    assert r.json()["detail"] == missing.json()["detail"].replace("'no-such-task'", repr(name))
    assert counts() == before


def test_no_refusal_lists_an_internal_name(api):
    step = {"id": "a", "task": "nope", "payload": {}}
    bodies = [
        (JOBS, {"task": "nope", "payload": {}}),
        ("/api/v1/jobs/batch/", {"jobs": [{"task": "nope", "payload": {}}]}),
        ("/api/v1/workflows/", {"name": "w", "steps": [step]}),
        ("/api/v1/schedules/", {"name": "s", "interval_seconds": 60, "task": "nope"}),
    ]
    texts = [post(api, url, body).content.decode() for url, body in bodies]
    assert all("unknown_task" in t and "echo" in t for t in texts), texts
    for name in internal_names():
        assert not any(name in t for t in texts), name


@pytest.mark.parametrize(
    "url,body,where",
    [
        ("/api/v1/jobs/batch/", {"jobs": [{"task": INTERNAL, "payload": {}}]}, "jobs.0.task"),
        (
            "/api/v1/workflows/",
            {"name": "w", "steps": [{"id": "a", "task": INTERNAL, "payload": {}}]},
            "steps[0].task",
        ),
        ("/api/v1/schedules/", {"name": "s", "interval_seconds": 60, "task": INTERNAL}, None),
    ],
)
def test_every_client_path_refuses_an_internal_task(api, url, body, where):
    before = counts()
    r = post(api, url, body)
    assert r.status_code == 400, r.content
    codes = [e["code"] for e in r.json().get("errors", {}).get(where, [])] if where else []
    assert "unknown_task" in codes or r.json()["code"] == "unknown_task", r.json()
    assert counts() == before


def test_a_setting_makes_an_internal_task_public(api, settings):
    settings.JOBS_PUBLIC_TASKS = [INTERNAL]
    assert post(api, JOBS, {"task": INTERNAL, "payload": {}}).status_code == 201


def test_code_still_submits_internal_tasks():
    from jobs.submission import submit

    job, created = submit(INTERNAL, {})
    assert created and job.task == INTERNAL


# --- no write to another client's rows --------------------------------------------------

# Rows that belong to no client (shared bookkeeping), so not "another client's rows".
# ArchivedPeriod: a period of every client's jobs, written by prunejobs only.
SHARED = {"WorkerProcess", "Queue", "OutboxCursor", "DomainEvent", "ArchivedPeriod"}
# How each client-owned table reaches its client.
OWNER_PATH = {
    "Client": "pk",
    "Job": "client",
    "JobEvent": "job__client",
    "Schedule": "client",
    "SchedulerRun": "schedule__client",
    "JobStep": "job__client",
    "JobSignal": "job__client",
    "Workflow": "client",
    "WorkflowNode": "workflow__client",
    "JobDependency": "child__client",
    "Webhook": "client",
    "WebhookDelivery": "webhook__client",
    # Flow control per key (jobs.flow): a client's id, 0 for code's own keys.
    "KeyHit": "client_key",
    "Debounce": "client_key",
    "Sequence": "owner",
    "SequenceWait": "sequence__owner",
    "Batch": "client",
    "BatchFailure": "batch__client",
}


def rows_of(client: Client) -> dict[str, list[dict]]:
    """Every row of every table that belongs to `client`, whole."""
    out = {}
    for model in apps.get_app_config("jobs").get_models():
        name = model.__name__
        if name in SHARED:
            continue
        assert name in OWNER_PATH, f"{name}: say how its rows reach their client"
        qs = model.objects.filter(**{OWNER_PATH[name]: client.pk}).order_by("pk")
        out[name] = [
            {k: (str(v) if isinstance(v, models.Model) else v) for k, v in row.items()}
            for row in qs.values()
        ]
    return out


def run_everything() -> None:
    dispatcher = Dispatcher([WebhookFanout()])
    for _ in range(3):
        dispatcher.tick()
        Worker(["default", signing.WEBHOOK_QUEUE], 2, burst=True, worker_id="w-tenants").run()


@pytest.fixture
def b_with_rows(other, settings):
    """Client B with a job, its delivered webhook event, a schedule and a workflow."""
    settings.JOBS_WEBHOOK_ALLOW_PRIVATE = True
    b, b_api = other
    receiver = Server()
    Dispatcher([WebhookFanout()]).tick()  # its first tick notes a horizon
    hook = post(b_api, "/api/v1/webhooks/", {"url": f"http://127.0.0.1:{receiver.port}/h",
                                              "events": ["job.done"]})  # fmt: skip
    assert hook.status_code == 201, hook.content
    assert post(b_api, JOBS, {"task": "echo", "payload": {"b": 1}}).status_code == 201
    assert post(b_api, "/api/v1/schedules/", {"name": "b", "interval_seconds": 3600,
                                              "task": "echo"}).status_code == 201  # fmt: skip
    steps = [{"id": "x", "task": "echo", "payload": {}},
             {"id": "y", "task": "echo", "payload": {}, "after": ["x"]}]  # fmt: skip
    wf = {"name": "bw", "steps": steps}
    assert post(b_api, "/api/v1/workflows/", wf).status_code == 201
    run_everything()
    deliveries = list(WebhookDelivery.objects.filter(webhook__client=b))
    assert [d.last_status_code for d in deliveries] == [200] * 3  # the job and two steps
    assert len(receiver.hosts) == 3
    yield b, receiver, deliveries[0]
    receiver.close()


def hostile_payload(b: Client, delivery: WebhookDelivery) -> dict:
    """A payload that names B's rows under every name a task might read."""
    job = Job.objects.filter(client=b).first()
    ids = {"delivery_id": delivery.pk, "job_id": job.pk, "id": job.pk,
           "webhook_id": delivery.webhook_id, "client_id": b.pk, "seconds": 0}  # fmt: skip
    return {**ids, "event": ids, "payload": ids}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("made_public", [[], [signing.DELIVER_TASK]])
def test_client_a_cannot_write_client_bs_rows_through_any_task(
    api, b_with_rows, settings, made_public
):
    """A submits every registered task with a payload naming B's rows; whatever is
    accepted runs on a real worker. With the delivery task made public, its own check
    (the delivery must be the one attached to this job) keeps B's row and receiver
    untouched. Test-suite tasks from other modules are cancelled unrun: only the
    product's tasks' effects are in question here."""
    b, receiver, delivery = b_with_rows
    settings.JOBS_PUBLIC_TASKS = ["echo", "sleep", "fail", *made_public]  # D196: opened by name
    before = rows_of(b)
    accepted = []
    for name in tasks.names():
        r = post(api, JOBS, {"task": name, "payload": hostile_payload(b, delivery)})
        if tasks.is_public(name):
            if r.status_code == 201:
                accepted.append((name, r.json()["id"]))
        else:
            assert r.status_code == 400 and r.json()["code"] == "unknown_task", (name, r.content)
    assert {"echo", "fail"} <= {n for n, _ in accepted}
    for name, job_id in accepted:
        if not tasks.get(name).fn.__module__.startswith("jobs."):
            assert api.post(f"{JOBS}{job_id}/cancel/").status_code in (200, 202)
    run_everything()
    assert rows_of(b) == before
    assert len(receiver.hosts) == 3  # only by B's own three events
    if made_public:
        job = Job.objects.get(pk=dict(accepted)[signing.DELIVER_TASK])
        assert job.status == "done" and "skipped" in job.result, job.result
