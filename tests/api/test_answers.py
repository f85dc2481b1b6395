"""The hand-written answer of `POST /api/v1/jobs/` (jobs.api.views.submitted_answer, D150) is the
serializer's document: the same keys in the same order, the same values, the same bytes."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest
from django.utils import timezone as dj_timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import queuecontrol, selectors
from jobs.api.renderers import ORJSONRenderer
from jobs.api.serializers import SubmittedJobSerializer
from jobs.api.views import submitted_answer
from jobs.lifecycle import STATUSES, WaitReason
from jobs.models import Job, Queue
from tests.api.conftest import authed, new_client

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
_zones = st.sampled_from(
    [UTC, timezone(timedelta(hours=5, minutes=30)), timezone(-timedelta(hours=8))]
)
_aware = st.builds(
    lambda d, tz: d.replace(tzinfo=UTC).astimezone(tz),
    st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(2200, 1, 1)),
    _zones,
)
_when = st.none() | _aware
_key = st.none() | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1)
_progress = st.none() | st.fixed_dictionaries(
    {"done": st.integers(0, 100) | st.floats(0, 100), "updated_at": st.text(max_size=30)},
    optional={"total": st.none() | st.integers(0, 100), "message": st.text(max_size=20)},
)
_jobs = st.builds(
    Job,
    id=st.integers(1, 2**63 - 1),
    task=st.text(min_size=1, max_size=30),
    queue=st.sampled_from(["default", "other"]),
    priority=st.integers(-100, 100),
    status=st.sampled_from(STATUSES),
    payload=_json,
    result=_json,
    error=st.none() | st.text(max_size=40),
    retry_count=st.integers(0, 10),
    max_retries=st.integers(0, 10),
    timeout=st.none() | st.floats(0.001, 86400) | st.integers(1, 86400),
    lease_version=st.integers(0, 2**63 - 1),
    idempotency_key=_key,
    run_at=_aware,
    created_at=_aware,
    updated_at=_aware,
    finished_at=_when,
    progress=_progress,
    cancel_requested_at=_when,
    unique_key=_key,
    concurrency_key=_key,
    schedule_id=st.none() | st.integers(1, 2**31),
    fire_time=_when,
    wait_reason=st.none() | st.sampled_from(list(WaitReason.values)),
)


def _same(job: Job) -> None:
    fast, drf = submitted_answer(job), SubmittedJobSerializer(job).data
    assert fast == drf
    assert list(fast) == list(drf)
    assert ORJSONRenderer().render(fast) == ORJSONRenderer().render(drf)


@pytest.mark.django_db
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_jobs, st.booleans(), st.sampled_from(["UTC", "Asia/Kolkata", "America/New_York"]))
def test_the_hand_written_answer_is_the_serializers(job, duplicate, zone):
    job.duplicate = duplicate
    with dj_timezone.override(zone):
        _same(job)


@pytest.mark.django_db
def test_a_naive_datetime_or_other_drf_settings_get_the_serializers_answer(settings):
    job = Job(id=1, task="echo", queue="default", status="queued", payload={},
              run_at=datetime(2030, 1, 1), created_at=datetime.now(UTC),
              updated_at=datetime.now(UTC))  # fmt: skip
    _same(job)
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DATETIME_FORMAT": "%Y"}
    job.run_at = datetime(2030, 1, 1, tzinfo=UTC)
    assert submitted_answer(job)["run_at"] == "2030"
    _same(job)


@pytest.mark.django_db
def test_a_submission_answers_the_serializers_bytes_for_the_stored_row():
    _, token = new_client()
    api = authed(token)
    bodies = [
        {"task": "echo", "payload": {"n": 1, "s": "é\u2028"}},
        {"task": "echo", "payload": [1, 2.5, None], "priority": 5, "timeout": 30,
         "run_at": "2031-05-06T07:08:09.123456+02:00", "unique_key": "u-1"},
    ]  # fmt: skip
    for body in bodies:
        r = api.post("/api/v1/jobs/", data=json.dumps(body), content_type="application/json")
        assert r.status_code == 201, r.content
        stored = Job.objects.get(pk=r.json()["id"])
        assert r.content == ORJSONRenderer().render(SubmittedJobSerializer(stored).data)
    again = api.post("/api/v1/jobs/", data=json.dumps(bodies[1]), content_type="application/json")
    assert again.status_code == 200 and again.json()["duplicate"] is True
    stored = Job.objects.get(pk=again.json()["id"])
    stored.duplicate = True
    assert again.content == ORJSONRenderer().render(SubmittedJobSerializer(stored).data)


@pytest.mark.django_db
def test_a_new_job_answers_its_queues_pause_as_read_by_its_insert(settings):
    """The 201 answer is rendered from the row the INSERT returned, which says whether the
    queue is paused (D372): the serializer's bytes for the stored row, even while this
    process's reading of the paused queues (at most a second old) does not know it yet."""
    settings.JOBS_QUEUES = {"default": {}, "mail": {}}
    queuecontrol.sync()
    _, token = new_client()
    api = authed(token)
    body = json.dumps({"task": "echo", "payload": 1, "queue": "mail"})
    assert selectors.paused_queues_cached() == frozenset()  # this process's reading
    Queue.objects.filter(name="mail").update(paused=True)  # paused by another process
    r = api.post("/api/v1/jobs/", data=body, content_type="application/json")
    assert r.status_code == 201, r.content
    assert r.json()["wait_reason"] == "queue_paused"
    selectors.forget_paused_queues()
    stored = Job.objects.get(pk=r.json()["id"])
    assert r.content == ORJSONRenderer().render(SubmittedJobSerializer(stored).data)
    Queue.objects.filter(name="mail").update(paused=False)
    r = api.post("/api/v1/jobs/", data=body, content_type="application/json")
    assert r.status_code == 201 and r.json()["wait_reason"] is None
    # The serializer's read above cached "mail" as paused for up to a second: a later
    # test of this process would render a stale wait reason from it.
    selectors.forget_paused_queues()


@pytest.mark.parametrize("prefix", ["/", "/svc/", "/a%20b/"])
@pytest.mark.parametrize("urlconf", [None, "tests.api.host_urls"])
def test_a_jobs_location_is_what_reverse_gives_under_any_urlconf_and_prefix(
    settings, prefix, urlconf
):
    """job_location keeps one template per URLconf and script prefix (D150)."""
    from django.urls import reverse, set_script_prefix, set_urlconf

    from jobs.api.views import job_location

    if urlconf:
        settings.ROOT_URLCONF = urlconf
    set_script_prefix(prefix)
    try:
        for pk in (1, 42, 2**63 - 1):
            assert job_location(pk) == reverse("job-detail", args=[pk])
        set_urlconf("tests.api.host_urls")  # a per-request URLconf wins over the setting
        assert job_location(7) == reverse("job-detail", args=[7])
        assert job_location(7).endswith("/jobs/api/jobs/7/")
    finally:
        set_urlconf(None)
        set_script_prefix("/")
