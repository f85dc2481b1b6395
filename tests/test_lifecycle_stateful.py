"""Random sequences of lifecycle operations against the real database.

A model predicts every row; after each step the row must match the model, obey
the per-state invariants of SPEC §2, and never have lowered its lease_version.
Stale writes are drawn from every lease ever issued, so most of them are stale.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
    run_state_machine_as_test,
)

from jobs import services
from jobs.lifecycle import TERMINAL, Status, is_legal
from jobs.models import JobEvent
from tests.conftest import job_row
from tests.factories import raw

WORKERS = st.sampled_from(["w-a", "w-b", "w-c"])


@dataclass
class Model:
    status: str
    lease_version: int
    retry_count: int
    max_retries: int
    owner: str | None
    due: bool


class Lifecycle(RuleBasedStateMachine):
    jobs = Bundle("jobs")
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.model: dict[int, Model] = {}
        self.seen_lease: dict[int, int] = {}

    def _held(self, lease: services.Lease) -> bool:
        m = self.model[lease.job_id]
        return (
            m.status == Status.PROCESSING
            and m.lease_version == lease.lease_version
            and m.owner == lease.worker_id
        )

    @rule(target=jobs, max_retries=st.integers(0, 3))
    def submit(self, max_retries):
        job, _ = services.submit("echo", {}, max_retries=max_retries)
        self.model[job.pk] = Model("queued", 0, 0, max_retries, None, True)
        return job.pk

    @rule(target=leases, job_id=jobs, worker=WORKERS)
    def claim(self, job_id, worker):
        m = self.model[job_id]
        lease = services.claim(worker, job_id)
        if m.status == Status.QUEUED and m.due:
            assert lease is not None and lease.lease_version == m.lease_version + 1
            m.status, m.lease_version, m.owner = "processing", m.lease_version + 1, worker
            return lease
        assert lease is None
        # Keep a forged lease around as a stale writer.
        return services.Lease(job_id, m.lease_version, worker, "echo", {}, "default", 0, 0, None)

    @rule(lease=leases)
    def heartbeat(self, lease):
        held = self._held(lease)
        assert (services.heartbeat([lease]) == {(lease.job_id, lease.lease_version)}) == held

    @rule(lease=leases)
    def complete(self, lease):
        held = self._held(lease)
        out = services.complete([(lease, {"by": lease.worker_id})])
        assert (lease.job_id in out) == held
        if held:
            m = self.model[lease.job_id]
            m.status, m.owner = "done", None

    @rule(lease=leases, permanent=st.booleans())
    def fail(self, lease, permanent):
        held = self._held(lease)
        out = services.fail([(lease, "boom", permanent)])
        assert (lease.job_id in out) == held
        if held:
            m = self.model[lease.job_id]
            m.owner = None
            if permanent:
                m.status = "failed"
            elif m.retry_count + 1 <= m.max_retries:
                m.status, m.lease_version, m.due = "queued", m.lease_version + 1, False
                m.retry_count += 1
            else:
                m.status, m.retry_count = "failed", m.retry_count + 1

    @rule(lease=leases)
    def release(self, lease):
        held = self._held(lease)
        assert (services.release([lease]) == {lease.job_id}) == held
        if held:
            m = self.model[lease.job_id]
            m.status, m.lease_version, m.owner, m.due = "queued", m.lease_version + 1, None, True

    @rule(job_id=jobs)
    def reap(self, job_id):
        m = self.model[job_id]
        if m.status == Status.PROCESSING:
            raw(
                "UPDATE jobs_job SET heartbeat_at = now() - interval '1 hour' WHERE id = %s",
                [job_id],
            )
        out = services.reap_expired(15)
        assert set(out) == ({job_id} if m.status == Status.PROCESSING else set())
        if m.status == Status.PROCESSING:
            m.retry_count += 1
            m.lease_version += 1
            m.owner = None
            m.status = "queued" if m.retry_count <= m.max_retries else "failed"
            m.due = True

    @rule(job_id=jobs)
    def make_due(self, job_id):
        raw("UPDATE jobs_job SET run_at = now() WHERE id = %s", [job_id])
        self.model[job_id].due = True

    @rule(job_id=jobs)
    def revoke(self, job_id):
        m = self.model[job_id]
        assert (services.revoke([job_id], "staff:t") == [job_id]) == (m.status == "processing")
        if m.status == Status.PROCESSING:
            m.status, m.lease_version, m.owner, m.due = "queued", m.lease_version + 1, None, True

    @rule(job_id=jobs)
    def staff_retry(self, job_id):
        m = self.model[job_id]
        assert (services.staff_retry([job_id], "staff:t") == [job_id]) == (m.status == "failed")
        if m.status == Status.FAILED:
            m.status, m.retry_count, m.due = "queued", 0, True

    @rule(job_id=jobs)
    def cancel(self, job_id):
        m = self.model[job_id]
        ok = m.status in (Status.QUEUED, Status.ENQUEUE_FAILED)
        assert (services.cancel([job_id], "client:t") == [job_id]) == ok
        if ok:
            m.status = "failed"

    @rule(job_id=jobs)
    def push_failed(self, job_id):
        m = self.model[job_id]
        ok = m.status == Status.QUEUED
        assert (services.mark_enqueue_failed([job_id]) == [job_id]) == ok
        if ok:
            m.status = "enqueue_failed"

    @rule(job_id=jobs)
    def repair(self, job_id):
        m = self.model[job_id]
        ok = m.status == Status.ENQUEUE_FAILED
        assert (services.repair_enqueue_failed(job_ids=[job_id]) == [job_id]) == ok
        if ok:
            m.status = "queued"

    @rule(job_id=jobs)
    def overspend_then_sweep(self, job_id):
        """A queued row already over budget (e.g. imported) is failed by the sweep."""
        m = self.model[job_id]
        if m.status in (Status.QUEUED, Status.ENQUEUE_FAILED):
            raw("UPDATE jobs_job SET retry_count = max_retries + 1 WHERE id = %s", [job_id])
            m.retry_count = m.max_retries + 1
        out = services.fail_over_budget()
        assert set(out) == (
            {job_id} if m.status in (Status.QUEUED, Status.ENQUEUE_FAILED) else set()
        )
        if m.status in (Status.QUEUED, Status.ENQUEUE_FAILED):
            m.status = "failed"

    @rule(lease=consumes(leases))
    def forget(self, lease):
        """Workers come and go; drop a lease from the pool."""

    @invariant()
    def rows_match_model_and_spec(self):
        for job_id, m in self.model.items():
            row = job_row(job_id)
            assert row["status"] == m.status
            assert row["lease_version"] == m.lease_version
            assert row["retry_count"] == m.retry_count
            assert row["owned_by"] == m.owner
            assert row["lease_version"] >= self.seen_lease.get(job_id, 0)
            self.seen_lease[job_id] = row["lease_version"]
            owned = row["status"] == Status.PROCESSING
            assert (row["owned_by"] is not None) == owned
            assert (row["claimed_at"] is not None) == owned
            assert (row["finished_at"] is not None) == (Status(row["status"]) in TERMINAL)
            if row["status"] == Status.DONE:
                assert row["error"] is None and row["result"] is not None
            if row["status"] == Status.FAILED:
                assert row["error"]
            assert row["retry_count"] >= 0 and row["lease_version"] >= 0

    @invariant()
    def history_is_legal_and_monotonic(self):
        for job_id in self.model:
            events = JobEvent.objects.filter(job_id=job_id, kind="transition").order_by("id")
            last_lv, last_status = 0, None
            for e in events:
                assert e.from_status == last_status
                assert last_status is None or is_legal(last_status, e.to_status)
                assert e.lease_version >= last_lv
                last_lv, last_status = e.lease_version, e.to_status
            assert last_status == self.model[job_id].status


@pytest.mark.django_db
def test_lifecycle_state_machine():
    run_state_machine_as_test(
        Lifecycle,
        settings=settings(
            max_examples=100,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
