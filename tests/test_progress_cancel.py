"""Progress reports and cancel requests at the service and database level (issue 22):
the fence on progress, the claim that clears it, and every requeue path that must
end a job with a pending cancel request instead of running it again."""

from __future__ import annotations

import json

import pytest
from django.db import IntegrityError, transaction

from jobs import services
from jobs.models import Job, JobEvent
from jobs.tasks import JobContext
from tests.conftest import job_row
from tests.factories import JobFactory, raw

pytestmark = pytest.mark.django_db

W = "w-1"


def claimed(worker: str = W, **kw) -> services.Lease:
    job = JobFactory.create(**kw)
    lease = services.claim(worker, job.pk)
    assert lease is not None
    return lease


def progress(job_id: int) -> dict | None:
    value = job_row(job_id)["progress"]
    return json.loads(value) if isinstance(value, str) else value


def stale_of(lease: services.Lease) -> services.Lease:
    fields = {f: getattr(lease, f) for f in services.Lease.__slots__}
    return services.Lease(**{**fields, "lease_version": lease.lease_version - 1})


# --- progress -----------------------------------------------------------------------


def test_heartbeat_writes_progress_stamped_by_the_database():
    lease = claimed()
    other = claimed()
    held = services.heartbeat([lease, other], [{"done": 3, "total": 10, "message": "m"}, None])
    assert held == {(lease.job_id, lease.lease_version), (other.job_id, other.lease_version)}
    report = progress(lease.job_id)
    assert (report["done"], report["total"], report["message"]) == (3, 10, "m")
    assert report["updated_at"]  # the database clock, not the worker's
    assert progress(other.job_id) is None  # None leaves the column alone
    services.heartbeat([lease])
    assert progress(lease.job_id)["done"] == 3  # a plain heartbeat keeps the last report


def test_a_stale_attempts_progress_is_refused():
    lease = claimed()
    services.heartbeat([lease], [{"done": 1, "total": 2, "message": "new"}])
    assert (
        services.heartbeat([stale_of(lease)], [{"done": 99, "total": 2, "message": "old"}]) == set()
    )
    assert progress(lease.job_id)["message"] == "new"


def test_a_new_attempt_starts_without_progress_and_the_terminal_row_keeps_it():
    lease = claimed()
    services.heartbeat([lease], [{"done": 5, "total": 10, "message": ""}])
    services.fail([(lease, "boom", False)])
    assert progress(lease.job_id)["done"] == 5  # kept between attempts until the claim
    raw("UPDATE jobs_job SET run_at = now() WHERE id = %s", [lease.job_id])
    again = services.claim(W, lease.job_id)
    assert progress(lease.job_id) is None
    services.heartbeat([again], [{"done": 7, "total": 10, "message": ""}])
    services.complete([(again, {"ok": True})])
    row = job_row(lease.job_id)
    assert row["status"] == "done" and progress(lease.job_id)["done"] == 7


def test_context_keeps_only_the_latest_report_and_refuses_bad_numbers():
    ctx = JobContext(1, 1, 1, W, "default", "t")
    ctx.progress(1, 10)
    ctx.progress(2, 10, "two")
    assert ctx._progress == (2, {"done": 2, "total": 10, "message": "two"})
    for bad in (True, "3", float("nan")):
        with pytest.raises(TypeError):
            ctx.progress(bad)
    for bad in (-1, float("inf")):
        with pytest.raises(ValueError):
            ctx.progress(bad)
    ctx.progress(1, None, "nul\x00 and lone \udce9")
    lease = claimed()
    # What the context keeps is always storable: jsonb would refuse the raw text.
    assert services.heartbeat([lease], [ctx._progress[1]])
    assert progress(lease.job_id)["message"] == "nul and lone ?"


def test_a_cancel_counts_as_seen_only_once_the_handler_looks():
    ctx = JobContext(1, 1, 1, W, "default", "t")
    assert not ctx.stop.is_set() and not ctx.cancelled
    ctx.request_cancel()
    assert not ctx.cancel_seen  # set, but nobody looked: a finished handler ends done
    assert ctx.stop.wait(0)
    assert ctx.cancel_seen
    other = JobContext(2, 1, 1, W, "default", "t")
    other.request_cancel()
    assert other.cancelled and other.cancel_seen
    assert not other.sleep(0)  # ctx.sleep wakes at once once stopped


# --- cancel requests ------------------------------------------------------------------


def test_request_cancel_fails_queued_jobs_and_flags_processing_ones():
    queued = JobFactory.create()
    parked = JobFactory.create(status="enqueue_failed")
    lease = claimed()
    done = JobFactory.create(status="done")
    ids = [queued.pk, parked.pk, lease.job_id, done.pk]
    out = services.request_cancel(ids, actor="client:c")
    assert out == {queued.pk: "cancelled", parked.pk: "cancelled", lease.job_id: "requested"}
    for pk in (queued.pk, parked.pk):
        row = job_row(pk)
        assert (row["status"], row["error"], row["cancel_requested_at"]) == (
            "failed",
            "cancelled",
            None,
        )
    row = job_row(lease.job_id)
    assert (row["status"], row["lease_version"], row["owned_by"]) == ("processing", 1, W)
    first = row["cancel_requested_at"]
    assert first is not None
    event = JobEvent.objects.filter(job_id=lease.job_id).order_by("-id").first()
    assert (event.kind, event.actor, event.from_status, event.to_status) == (
        "cancel_requested", "client:c", "processing", "processing",
    )  # fmt: skip
    # Asking again keeps the first request's time; the heartbeat answer carries it.
    assert services.request_cancel([lease.job_id], actor="client:c") == {lease.job_id: "requested"}
    assert job_row(lease.job_id)["cancel_requested_at"] == first
    held = services.heartbeat([lease])
    assert held.cancel_requested == {(lease.job_id, lease.lease_version)}
    assert job_row(done.pk)["status"] == "done"


def test_request_cancel_touches_only_the_clients_own_jobs():
    lease = claimed()
    raw("INSERT INTO jobs_client (name, token_hash, is_active, created_at) "
        "VALUES ('someone', 'x', true, now())")  # fmt: skip
    other = raw("SELECT id FROM jobs_client WHERE name = 'someone'")[0][0]
    assert services.request_cancel([lease.job_id], actor="client:someone", client_id=other) == {}
    assert job_row(lease.job_id)["cancel_requested_at"] is None


def _requested(**kw) -> services.Lease:
    lease = claimed(**kw)
    assert services.request_cancel([lease.job_id], actor="client:c") == {lease.job_id: "requested"}
    return lease


def _ended_cancelled(job_id: int, actor: str) -> None:
    row = job_row(job_id)
    assert (row["status"], row["error"], row["owned_by"]) == ("failed", "cancelled", None)
    assert row["finished_at"] is not None
    last = JobEvent.objects.filter(job_id=job_id, kind="transition").order_by("-id").first()
    assert (last.from_status, last.to_status, last.actor, last.error) == (
        "processing", "failed", actor, "cancelled",
    )  # fmt: skip
    # Nothing can claim it again.
    assert services.claim("w-next", job_id) is None


def test_a_retryable_failure_with_a_pending_cancel_ends_cancelled():
    lease = _requested()
    finished = services.fail([(lease, "boom", False, "builtins.ValueError", "tb")])
    assert finished[lease.job_id].status == "failed"
    _ended_cancelled(lease.job_id, f"worker:{W}")
    assert job_row(lease.job_id)["error_class"] == "builtins.ValueError"


def test_an_expired_lease_with_a_pending_cancel_ends_cancelled():
    lease = _requested()
    raw(
        "UPDATE jobs_job SET heartbeat_at = now() - interval '1 hour' WHERE id = %s", [lease.job_id]
    )
    finished = services.reap_expired(lease_seconds=5)
    assert finished[lease.job_id].status == "failed"
    _ended_cancelled(lease.job_id, "reaper")


def test_a_released_or_revoked_job_with_a_pending_cancel_ends_cancelled():
    released = _requested()
    assert services.release([released]) == {released.job_id}
    _ended_cancelled(released.job_id, f"worker:{W}")
    revoked = _requested()
    assert services.revoke([revoked.job_id], actor="staff:s") == [revoked.job_id]
    _ended_cancelled(revoked.job_id, "staff:s")


def test_a_waiting_job_cannot_carry_a_cancel_request():
    """The database refuses the state the claim must never see, whoever writes it."""
    for status in ("queued", "enqueue_failed"):
        job = JobFactory.create(status=status)
        with pytest.raises(IntegrityError, match="job_waiting_has_no_cancel_request"):
            with transaction.atomic():
                raw("UPDATE jobs_job SET cancel_requested_at = now() WHERE id = %s", [job.pk])


def test_a_job_without_a_request_is_still_retried():
    lease = claimed()
    services.fail([(lease, "boom", False)])
    assert job_row(lease.job_id)["status"] == "queued"


def test_a_staff_retry_forgets_the_old_cancel_request():
    lease = _requested()
    services.fail([(lease, "cancelled", True)])
    assert services.staff_retry([lease.job_id], actor="staff:s") == [lease.job_id]
    assert Job.objects.get(pk=lease.job_id).cancel_requested_at is None
    again = services.claim(W, lease.job_id)
    services.fail([(again, "boom", False)])
    assert job_row(lease.job_id)["status"] == "queued"  # retried as usual
