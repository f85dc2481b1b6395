"""Property-based fuzzing of every operation in the served OpenAPI document
(schemathesis), against the real PostgreSQL and Redis.

Each operation gets schema-valid (positive) and schema-breaking (negative) requests,
authenticated as a real client, half of them aimed at a job that exists. Every answer
must be a non-5xx that conforms to the document (status code, content type, body
schema); afterwards every row the fuzz left behind must be legal. `make test` runs a
short pass; `make fuzz` a long one (FUZZ_EXAMPLES per operation and mode).
"""

from __future__ import annotations

import importlib
import os
import re

import pytest
import schemathesis
from django.db import connection
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from jobs import admission, queues, signals, submission, tasks, validation
from jobs.events import signing
from jobs.lifecycle import STATUSES, is_legal
from jobs.models import Client, Job, JobEvent, JobSignal, Schedule, Webhook, Workflow
from tests.api.conftest import EXERCISED, new_client

pytestmark = [pytest.mark.django_db(transaction=True)]

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "15"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
RAN: dict[str, int] = {}
STATUSES_SEEN: dict[str, dict[int, int]] = {}
# Where this repository's test and example tasks live (D196): the built-ins, the demo
# app, the fault suite and the bench. The fuzz names each of their tasks.
EXAMPLE_MODULES = ("jobs.tasks", "demo.tasks", "chaos.tasks", "bench.tasks")
for _module in EXAMPLE_MODULES:
    importlib.import_module(_module)
OWN_TASK = "fuzz.own"


@tasks.task(OWN_TASK)
def own(payload, ctx):
    """A host project's own task: public, as any @task without `example`."""
    return payload


@pytest.fixture(autouse=True)
def deployment_public_tasks(request):
    """The deployment's JOBS_PUBLIC_TASKS (none), not the suite's opt-in: every test and
    example task must then be refused, and the row check below holds the fuzz to it.
    Through pytest-django's `settings`, which the conftest's autouse fixture holds too: one
    wrapper restores every override in order."""
    request.getfixturevalue("settings").JOBS_PUBLIC_TASKS = []


def example_tasks() -> list[str]:
    """Told by the module that registers them, not by their flag."""
    return [name for name in tasks.names() if tasks.get(name).fn.__module__ in EXAMPLE_MODULES]


def test_no_test_or_example_task_is_public_in_the_deployment():
    examples = set(example_tasks())
    assert {"echo", "sleep", "fail", "demo.crash", "demo.record", "chaos.die"} <= examples
    assert all(tasks.get(name).example for name in examples)
    assert not examples & set(tasks.public_names()), examples & set(tasks.public_names())
    assert OWN_TASK in tasks.public_names()  # a project's own task stays public
    with override_settings(JOBS_PUBLIC_TASKS=["echo"]):  # opened by name only
        assert set(tasks.public_names()) & examples == {"echo"}


@pytest.fixture(scope="module")
def schema(django_db_blocker):
    """Loaded once per module, before any test's own database fixture: the request that
    fetches it may touch the database (Django's request_started handler does). The
    application is the servers' own, the single submission's lane in front of Django."""
    from django.core.wsgi import get_wsgi_application

    from jobs.api.fastlane import FastLane

    with django_db_blocker.unblock():
        app = FastLane(get_wsgi_application())
        return schemathesis.openapi.from_wsgi("/api/v1/schema/?format=json", app)


def _operations() -> list[tuple[str, str]]:
    from tests.api.test_schema import EXPECTED_OPERATIONS

    return sorted(EXPECTED_OPERATIONS)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize("method,path", _operations())
def test_fuzz_operation(schema, method, path, mode):
    """No 5xx, and every answer is what the document says, for generated requests."""
    client, token = new_client(f"fuzz-{method}-{path}-{mode}")
    existing, _ = submission.submit(OWN_TASK, {"seed": 1}, client=client)
    operation = schema[path][method]
    strategy = operation.as_strategy(generation_mode=mode)
    if "{id}" in path:
        strategy = st.one_of(
            strategy,
            operation.as_strategy(generation_mode=mode, path_parameters={"id": existing.pk}),
        )
    headers = {"Authorization": f"Token {token}"}
    label = f"{method} {path} {mode}"

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=os.environ.get("FUZZ_RANDOM") is None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy, task=st.sampled_from([None, *tasks.names()]))
    def run(case, task):
        case.headers = {**(case.headers or {}), **headers}
        if task is not None:  # a registered task, so the write path is reached too
            _name_task(case.body, task)
        response = case.call()
        RAN[label] = RAN.get(label, 0) + 1
        seen = STATUSES_SEEN.setdefault(label, {})
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
        case.validate_response(response, checks=CHECKS)

    run()
    EXERCISED.add((method, path))
    assert RAN.get(label, 0) >= min(EXAMPLES, 5), RAN
    assert_only_legal_rows()
    print(f"\n{label}: {RAN[label]} cases, by status {dict(sorted(STATUSES_SEEN[label].items()))}")


# A schema-valid body per path that creates jobs, running `task`.
CREATES_JOBS = {
    "/api/v1/jobs/": lambda task: {"task": task, "payload": {}},
    "/api/v1/jobs/batch/": lambda task: {"jobs": [{"task": task, "payload": {}}]},
    "/api/v1/workflows/": lambda task: {"name": "w", "steps": [{"id": "a", "task": task,
                                                                "payload": {}}]},
    "/api/v1/schedules/": lambda task: {"name": "s", "interval_seconds": 60, "task": task,
                                        "payload": {}},
}  # fmt: skip


def test_every_test_and_example_task_is_refused_on_every_path_that_creates_jobs(schema):
    """The generated cases above name every task at random; here each test and example
    task goes through each path once, as the document describes the request."""
    client, token = new_client("fuzz-examples")
    examples = example_tasks()
    for path, body in CREATES_JOBS.items():
        for task in examples:
            case = schema[path]["POST"].Case(
                body=body(task),
                headers={"Authorization": f"Token {token}"},
                media_type="application/json",
            )
            response = case.call()
            assert response.status_code == 400, (path, task, response.text[:300])
            answer = response.json()
            codes = {answer["code"]} | {
                e["code"] for errs in answer.get("errors", {}).values() for e in errs
            }
            assert "unknown_task" in codes, (path, task, response.text[:300])
            case.validate_response(response, checks=CHECKS)
    assert not Job.objects.filter(client=client).exists()
    assert not Schedule.objects.filter(client=client).exists()


def _name_task(body, task: str) -> None:
    """Every task name, internal, test and example ones included: those must be refused
    (unknown_task)."""
    items = (body.get("jobs") or body.get("steps")) if isinstance(body, dict) else None
    for job in items if isinstance(items, list) else [body]:
        if isinstance(job, dict) and "task" in job:
            job["task"] = task


def assert_only_legal_rows() -> None:
    """What the database does not enforce itself, checked over every row left behind
    (its check constraints and trigger have refused anything else already)."""
    known_tasks = set(tasks.names())
    key_re = validation.IDEMPOTENCY_KEY_RE
    for job in Job.objects.all():
        assert job.status in STATUSES
        assert queues.is_declared(job.queue), job.queue
        assert job.task in known_tasks, job.task
        if job.client_id is not None:  # a client's job: a public task, in an open queue
            assert tasks.is_public(job.task), job.task
            assert not queues.is_internal(job.queue), job.queue
        assert job.payload is not None and job.run_at is not None
        validation.serialise_payload(job.payload)  # storable, within the limit
        if job.idempotency_key is not None:
            assert key_re.fullmatch(job.idempotency_key) and job.request_hash
        events = list(JobEvent.objects.filter(job_id=job.pk, kind="transition").order_by("id"))
        assert events and events[0].from_status is None and events[0].to_status == "queued"
        for e in events[1:]:
            assert is_legal(e.from_status, e.to_status), (e.from_status, e.to_status)
        assert events[-1].to_status == job.status
    assert_within_quotas_and_storable()
    with connection.cursor() as cur:  # the constraints are in place and validated
        cur.execute(
            "SELECT count(*) FROM pg_constraint WHERE conrelid = 'jobs_job'::regclass "
            "AND contype = 'c' AND convalidated"
        )
        assert cur.fetchone()[0] >= 10


def assert_within_quotas_and_storable() -> None:
    """No client past its schedule or webhook quota, no job past its signal quota, and
    every name and key stored as text the API would accept again."""
    for client in Client.objects.all():
        for quota, held in (
            (admission.SCHEDULES, Schedule.objects.filter(client=client).count()),
            (admission.WEBHOOKS, Webhook.objects.filter(client=client).count()),
        ):
            assert held <= admission.quota_limit(quota, client.pk), (client.name, quota.what, held)
    for signal in JobSignal.objects.all():
        signals.check_key(signal.key)
        client_id = Job.objects.get(pk=signal.job_id).client_id
        held = JobSignal.objects.filter(job_id=signal.job_id).count()
        assert held <= admission.quota_limit(admission.SIGNALS_PER_JOB, client_id), signal.job_id
    for name in Schedule.objects.values_list("name", flat=True):
        assert not validation.why_unstorable(name), name
    for name in Workflow.objects.values_list("name", flat=True):
        assert not validation.why_unstorable(name), name


def test_legal_row_check_catches_an_illegal_row(db):
    """The check above is not vacuous: a row written around the API fails it."""
    Job.objects.create(task="no-such-task", payload={}, queue="default", max_retries=3)
    with pytest.raises(AssertionError):
        assert_only_legal_rows()


def test_idempotency_pattern_is_whole_match():
    assert not re.fullmatch(validation.IDEMPOTENCY_KEY_RE, "k\n")


def test_legal_row_check_catches_an_internal_task_of_a_client(db):
    client, _ = new_client("fuzz-internal")
    Job.objects.create(task=signing.DELIVER_TASK, payload={}, queue="webhooks", max_retries=3,
                       client=client)  # fmt: skip
    with pytest.raises(AssertionError):
        assert_only_legal_rows()


def test_legal_row_check_catches_an_example_task_of_a_client(db):
    client, _ = new_client("fuzz-example")
    Job.objects.create(task="demo.crash", payload={}, queue="default", max_retries=3,
                       client=client)  # fmt: skip
    with pytest.raises(AssertionError, match="demo.crash"):
        assert_only_legal_rows()


def test_quota_check_catches_a_client_past_its_quota(db, settings):
    settings.JOBS_MAX_WEBHOOKS = 0
    client, _ = new_client("fuzz-quota")
    Webhook.objects.create(client=client, url="http://127.0.0.1:9/", events=["*"],
                           secret_salt=signing.new_salt())  # fmt: skip
    with pytest.raises(AssertionError):
        assert_within_quotas_and_storable()
