"""jobs.submission.submit: the Python API for Django code, same rules as the REST API."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.db import transaction
from prometheus_client import REGISTRY

from jobs import submission, validation
from jobs.models import Job
from jobs.submission import submit
from jobs.transport import get_transport
from tests.api.conftest import counts, new_client


@pytest.mark.django_db
def test_submit_in_the_callers_transaction(django_capture_on_commit_callbacks):
    run_at = datetime.now(UTC) + timedelta(minutes=5)
    with django_capture_on_commit_callbacks() as callbacks:
        with transaction.atomic():
            job, created = submit(
                "echo", {"a": 1}, queue="mail", priority=5, run_at=run_at, max_retries=7
            )
    assert created
    row = Job.objects.get(pk=job.pk)
    assert (row.task, row.payload, row.queue, row.priority, row.max_retries) == (
        "echo", {"a": 1}, "mail", 5, 7,
    )  # fmt: skip
    assert row.run_at == run_at
    assert row.client is None and row.updated_by == "app"
    submitted = REGISTRY.get_sample_value("jobs_submitted_total", {"queue": "mail", "task": "echo"})
    for callback in callbacks:  # what runs on commit: the count, and no push (D4)
        callback()
    t = get_transport()
    assert t._client.llen(t.key("mail")) == 0  # scheduled for later: no push now
    assert (
        REGISTRY.get_sample_value("jobs_submitted_total", {"queue": "mail", "task": "echo"})
        == (submitted or 0) + 1
    )


@pytest.mark.django_db
def test_submit_as_a_client_with_an_idempotency_key():
    client, _ = new_client()
    job, created = submit("echo", {"a": 1}, idempotency_key="k", client=client)
    again, created_again = submit("echo", {"a": 1}, idempotency_key="k", client=client)
    assert (created, created_again) == (True, False)
    assert again.pk == job.pk and again.client_id == client.pk
    with pytest.raises(submission.IdempotencyConflict) as exc:
        submit("echo", {"a": 2}, idempotency_key="k", client=client)
    assert exc.value.job.pk == job.pk
    # The same key without a client is another scope.
    other, created_other = submit("echo", {"a": 2}, idempotency_key="k")
    assert created_other and other.pk != job.pk


class Unserialisable:
    pass


REFUSED = [
    ("unknown task", ("nope", {}), {}, submission.UnknownTask, "unknown_task"),
    ("task not a string", (None, {}), {}, submission.UnknownTask, "unknown_task"),
    ("payload None", ("echo", None), {}, submission.InvalidSubmission, "invalid_payload"),
    ("payload object", ("echo", {"x": Unserialisable()}), {}, submission.InvalidSubmission,
     "invalid_payload"),
    ("payload set", ("echo", {1, 2}), {}, submission.InvalidSubmission, "invalid_payload"),
    ("payload NaN", ("echo", {"x": float("nan")}), {}, submission.InvalidSubmission,
     "invalid_payload"),
    ("payload NUL key", ("echo", {"a\x00": 1}), {}, submission.InvalidSubmission,
     "invalid_payload"),
    ("payload refused by task", ("sleep", {"seconds": "x"}), {}, submission.InvalidSubmission,
     "invalid_payload"),
    ("priority bool", ("echo", {}), {"priority": True}, submission.InvalidSubmission,
     "invalid_priority"),
    ("priority float", ("echo", {}), {"priority": 1.5}, submission.InvalidSubmission,
     "invalid_priority"),
    ("priority range", ("echo", {}), {"priority": 1000}, submission.InvalidSubmission,
     "invalid_priority"),
    ("max_retries range", ("echo", {}), {"max_retries": 101}, submission.InvalidSubmission,
     "invalid_max_retries"),
    ("max_retries negative", ("echo", {}), {"max_retries": -1}, submission.InvalidSubmission,
     "invalid_max_retries"),
    ("run_at naive", ("echo", {}), {"run_at": datetime(2030, 1, 1)},
     submission.InvalidSubmission, "invalid_run_at"),
    ("run_at string", ("echo", {}), {"run_at": "2030-01-01T00:00:00Z"},
     submission.InvalidSubmission, "invalid_run_at"),
    ("queue empty", ("echo", {}), {"queue": ""}, submission.InvalidSubmission, "invalid_queue"),
    ("queue too long", ("echo", {}), {"queue": "q" * 101}, submission.InvalidSubmission,
     "invalid_queue"),
    ("key empty", ("echo", {}), {"idempotency_key": ""}, submission.InvalidSubmission,
     "invalid_idempotency_key"),
    ("timeout zero", ("echo", {}), {"timeout": 0}, submission.InvalidSubmission,
     "invalid_timeout"),
    ("timeout negative", ("echo", {}), {"timeout": -1}, submission.InvalidSubmission,
     "invalid_timeout"),
    ("timeout bool", ("echo", {}), {"timeout": True}, submission.InvalidSubmission,
     "invalid_timeout"),
    ("timeout NaN", ("echo", {}), {"timeout": float("nan")}, submission.InvalidSubmission,
     "invalid_timeout"),
    ("timeout string", ("echo", {}), {"timeout": "5"}, submission.InvalidSubmission,
     "invalid_timeout"),
    ("timeout over the max", ("echo", {}), {"timeout": 86401}, submission.InvalidSubmission,
     "invalid_timeout"),
]  # fmt: skip


@pytest.mark.django_db
@pytest.mark.parametrize(
    "args,kwargs,error,code", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_refused_submission_raises_and_writes_nothing(
    args, kwargs, error, code, django_capture_on_commit_callbacks
):
    before = counts()
    with django_capture_on_commit_callbacks() as callbacks:
        with pytest.raises(error) as exc:
            submit(*args, **kwargs)
    assert exc.value.code == code
    assert isinstance(exc.value, submission.SubmissionError)
    assert counts() == before
    assert callbacks == []


@pytest.mark.django_db
def test_payload_too_large(settings):
    settings.JOBS_MAX_PAYLOAD_BYTES = 100
    before = counts()
    with pytest.raises(submission.PayloadTooLarge):
        submit("echo", {"x": "y" * 100})
    assert counts() == before


def test_request_hash_is_canonical():
    at = datetime(2030, 1, 1, 12, tzinfo=UTC)
    same_instant = at.astimezone(ZoneInfo("Europe/Paris"))
    h = validation.request_hash("echo", {"a": 1, "b": 2}, "q", 0, at, 3)
    assert h == validation.request_hash("echo", {"b": 2, "a": 1}, "q", 0, same_instant, 3)
    assert h != validation.request_hash("echo", {"a": 1, "b": 2}, "q", 0, None, 3)
    assert h != validation.request_hash("echo", {"a": 1, "b": 3}, "q", 0, at, 3)
    assert len(h) == 64
