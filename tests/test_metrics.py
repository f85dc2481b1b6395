"""Job metrics counted once per committed event, the depth collector, and log fields
(SPEC §7), in this process against the real PostgreSQL and Redis."""

from __future__ import annotations

import json
import logging
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client import REGISTRY

from jobs import services, submission
from jobs.collectors import DepthCollector
from jobs.logconfig import JOB_FIELDS, JsonFormatter, job_log_fields
from jobs.models import Job
from tests.harness import free_port


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def jobs_log(caplog):
    """caplog for the `jobs` loggers, which do not propagate to the root logger."""
    logger = logging.getLogger("jobs")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="jobs")
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.mark.django_db(transaction=True)
def test_a_submission_is_counted_when_its_transaction_commits():
    def submitted() -> float:
        return sample("jobs_submitted_total", queue="obs-commit", task="echo")

    before = submitted()
    with pytest.raises(RuntimeError), transaction.atomic():
        services.submit("echo", {}, queue="obs-commit")
        raise RuntimeError("the caller's own write failed")
    assert submitted() == before  # the job never existed
    with transaction.atomic():
        services.submit("echo", {}, queue="obs-commit")
        assert submitted() == before  # not yet committed
    assert submitted() == before + 1
    submission.submit("echo", {}, queue="obs-commit")  # autocommit: at once
    assert submitted() == before + 2


@pytest.mark.django_db(transaction=True)
def test_a_terminal_state_is_counted_only_once_committed():
    labels = {"queue": "obs-term", "task": "echo", "outcome": "done"}

    def counts() -> tuple[float, float, float]:
        return (
            sample("jobs_finished_total", **labels),
            sample("jobs_time_to_terminal_seconds_count", **labels),
            sample("jobs_retries_count", **labels),
        )

    job, _ = services.submit("echo", {}, queue="obs-term")
    lease = services.claim("w-obs", job.pk)
    before = counts()
    with pytest.raises(RuntimeError), transaction.atomic():
        assert job.pk in services.complete([(lease, {"ok": 1})])
        raise RuntimeError("a transactional handler's effects failed to commit")
    assert counts() == before
    assert Job.objects.get(pk=job.pk).status == "processing"
    assert job.pk in services.complete([(lease, {"ok": 1})])
    assert counts() == tuple(x + 1 for x in before)
    # The same lease cannot finish it twice, so it is not counted twice.
    assert services.complete([(lease, {"ok": 1})]) == {}
    assert counts() == tuple(x + 1 for x in before)


@pytest.mark.django_db(transaction=True)
def test_redis_down_at_submission_counts_parked_jobs_and_redis_errors():
    queue = "obs-parked"
    before = (
        sample("jobs_submitted_total", queue=queue, task="echo"),
        sample("jobs_enqueue_failed_total", queue=queue),
        sample("jobs_redis_errors_total", op="push"),
    )
    with override_settings(REDIS_URL=f"redis://127.0.0.1:{free_port()}/0"):
        ids = [submission.submit("echo", {"n": i}, queue=queue)[0].pk for i in range(3)]
    assert set(Job.objects.filter(pk__in=ids).values_list("status", flat=True)) == {
        "enqueue_failed"
    }
    after = (
        sample("jobs_submitted_total", queue=queue, task="echo"),
        sample("jobs_enqueue_failed_total", queue=queue),
        sample("jobs_redis_errors_total", op="push"),
    )
    assert [a - b for a, b in zip(after, before, strict=True)] == [3, 3, 3]


@pytest.mark.django_db(transaction=True)
def test_staff_actions_are_counted_per_job_changed():
    def staff(action: str) -> float:
        return sample("jobs_staff_actions_total", action=action)

    failed = []
    for _ in range(2):
        job, _ = services.submit("echo", {}, queue="obs-staff")
        services.fail([(services.claim("w-obs", job.pk), "boom", True)])
        failed.append(job.pk)
    before = staff("retry")
    with pytest.raises(RuntimeError), transaction.atomic():
        # Ids in RETURNING's order, which is the rows' and not the argument's.
        assert sorted(services.staff_retry(failed, "staff:alice")) == sorted(failed)
        raise RuntimeError("rolled back")
    assert staff("retry") == before
    assert sorted(services.staff_retry(failed, "staff:alice")) == sorted(failed)
    assert staff("retry") == before + 2
    assert services.staff_retry(failed, "staff:alice") == []  # no longer failed: no count
    assert staff("retry") == before + 2

    before_cancel = staff("cancel")
    assert services.cancel(failed[:1], "client:someone") == failed[:1]
    assert services.cancel(failed[1:], "staff:alice") == failed[1:]
    assert staff("cancel") == before_cancel + 1  # the client's own cancel is not staff's


@pytest.mark.django_db(transaction=True)
def test_an_expired_lease_is_counted_and_logged_with_the_lease_it_took_away(jobs_log, sql):
    job, _ = services.submit("echo", {}, queue="obs-reap")
    lease = services.claim("w-gone", job.pk)
    sql("UPDATE jobs_job SET heartbeat_at = now() - interval '1 minute' WHERE id = %s", [job.pk])
    before = sample("jobs_lease_expired_total", queue="obs-reap")
    jobs_log.clear()
    assert job.pk in services.reap_expired(15)
    assert sample("jobs_lease_expired_total", queue="obs-reap") == before + 1
    (record,) = [r for r in jobs_log.records if getattr(r, "job_id", None) == job.pk]
    assert record.levelno == logging.WARNING
    assert (record.lease_version, record.new_lease_version) == (lease.lease_version, 2)
    assert (record.worker_id, record.queue, record.task) == ("w-gone", "obs-reap", "echo")


@pytest.mark.django_db(transaction=True)
def test_submitting_is_quiet_at_info(jobs_log):
    jobs_log.set_level(logging.INFO, logger="jobs")
    for i in range(5):
        submission.submit("echo", {"n": i}, queue="obs-quiet")
    assert [r for r in jobs_log.records if r.levelno >= logging.INFO] == []


def test_json_log_lines_carry_the_job_identity():
    record = logging.makeLogRecord(
        {
            "name": "jobs.worker",
            "levelno": logging.WARNING,
            "levelname": "WARNING",
            "msg": "fence rejected stale %s",
            "args": ("complete",),
            **job_log_fields(7, 3, "host:1:ab", "default", "echo", current_lease_version=4),
        }
    )
    doc = json.loads(JsonFormatter().format(record))
    assert doc["msg"] == "fence rejected stale complete" and doc["level"] == "warning"
    assert {k: doc[k] for k in JOB_FIELDS} == {
        "job_id": 7,
        "lease_version": 3,
        "worker_id": "host:1:ab",
        "queue": "default",
        "task": "echo",
    }
    assert doc["current_lease_version"] == 4


def _collect(collector: DepthCollector) -> dict[str, dict[tuple[str, str], float]]:
    out: dict[str, dict[tuple[str, str], float]] = {}
    for family in collector.collect():
        out[family.name] = {(s.labels["state"], s.labels["queue"]): s.value for s in family.samples}
    return out


@pytest.mark.django_db
def test_depth_collector_answers_from_one_grouped_query_cached_between_scrapes():
    a = [services.submit("echo", {}, queue="obs-a")[0].pk for _ in range(3)]
    services.submit("echo", {}, queue="obs-a", run_at=timezone.now() + timedelta(hours=1))
    assert services.claim("w-obs", a[0])
    done = services.claim("w-obs", a[1])
    services.complete([(done, None)])
    b = [services.submit("echo", {}, queue="obs-b")[0].pk for _ in range(2)]
    services.mark_enqueue_failed(b)
    services.submit("echo", {}, queue="obs-c", run_at=timezone.now() + timedelta(hours=1))

    now = [100.0]
    collector = DepthCollector(cache_seconds=5, clock=lambda: now[0])
    with CaptureQueriesContext(connection) as queries:
        got = _collect(collector)
    assert len(queries) == 1
    depth = got["jobs_depth"]
    assert depth == {
        ("queued", "obs-a"): 2,  # one due, one scheduled
        ("processing", "obs-a"): 1,
        ("enqueue_failed", "obs-a"): 0,
        ("queued", "obs-b"): 0,
        ("processing", "obs-b"): 0,
        ("enqueue_failed", "obs-b"): 2,
        ("queued", "obs-c"): 1,
        ("processing", "obs-c"): 0,
        ("enqueue_failed", "obs-c"): 0,
    }
    for (state, queue), n in depth.items():
        assert Job.objects.filter(status=state, queue=queue).count() == n
    ages = got["jobs_oldest_age_seconds"]
    assert set(ages) == set(depth) and all(age >= 0 for age in ages.values())
    assert ages[("queued", "obs-c")] == 0  # only a future job: nothing is waiting

    services.submit("echo", {}, queue="obs-a")
    now[0] += 4.9
    with CaptureQueriesContext(connection) as queries:
        assert _collect(collector)["jobs_depth"][("queued", "obs-a")] == 2  # cached
    assert len(queries) == 0
    now[0] += 0.2
    assert _collect(collector)["jobs_depth"][("queued", "obs-a")] == 3
    assert collector.reads == 2
