"""The two wake-ups that must not be lost, raced for real on separate connections:
two last parents ending at once, and a signal arriving while its job parks."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.db import connection

from jobs import services, signals, workflows
from jobs.lifecycle import BLOCKED_RUN_AT, WaitReason
from jobs.models import Job, WorkflowNode
from jobs.services import fencing, waits

pytestmark = pytest.mark.django_db(transaction=True)


def _conn() -> psycopg.Connection:
    settings = connection.settings_dict
    return psycopg.connect(
        host=settings["HOST"] or "127.0.0.1", port=settings["PORT"] or 5432,
        user=settings["USER"], dbname=settings["NAME"],
    )  # fmt: skip


def _complete_params(lease: services.Lease) -> dict:
    return {"ids": [lease.job_id], "lvs": [lease.lease_version], "owners": [lease.worker_id],
            "results": ["1"]}  # fmt: skip


def _blocked_on_lock(conn: psycopg.Connection) -> bool:
    with _conn() as probe:
        pid = conn.info.backend_pid
        row = probe.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid]
        ).fetchone()
        return row is not None and row[0] == "Lock"


def test_two_last_parents_ending_at_once_both_count_and_the_child_wakes():
    wf = workflows.Workflow("race").step("a", "echo").step("b", "echo")
    wf.step("c", "echo", after=["a", "b"])
    ids = dict(WorkflowNode.objects.filter(workflow_id=wf.submit()).values_list("key", "job_id"))
    a, b = services.claim("w-a", ids["a"]), services.claim("w-b", ids["b"])
    first, second = _conn(), _conn()
    try:
        first.execute(fencing._COMPLETE_SQL, _complete_params(a))  # a ends, not committed
        done = threading.Event()

        def end_b() -> None:
            second.execute(fencing._COMPLETE_SQL, _complete_params(b))
            second.commit()
            done.set()

        racer = threading.Thread(target=end_b)
        racer.start()
        deadline = time.monotonic() + 10
        while not _blocked_on_lock(second) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not done.is_set()  # b's end waits for a's count of c, not a snapshot
        first.commit()
        racer.join(10)
        assert done.is_set()
    finally:
        first.close()
        second.close()
    child = Job.objects.get(pk=ids["c"])
    assert child.wait_reason is None and child.run_at.year < 9999
    assert WorkflowNode.objects.get(job_id=ids["c"]).pending_parents == 0
    assert services.claim("w-c", ids["c"]) is not None


def test_a_signal_sent_while_its_job_parks_wakes_it():
    job, _ = services.submit("echo", {})
    lease = services.claim("w-park", job.pk)
    parking = _conn()
    try:
        # The park's first statement holds the job's row; the signal must wait for it.
        parking.execute(
            waits._SUSPEND_SQL,
            {"id": lease.job_id, "lv": lease.lease_version, "owner": lease.worker_id,
             "until": BLOCKED_RUN_AT, "seconds": None, "reason": WaitReason.SIGNAL.value,
             "key": "go", "name": None, "blocked": BLOCKED_RUN_AT},
        )  # fmt: skip
        result: list = []
        sender = threading.Thread(
            target=lambda: result.append(signals.signal_job(job.pk, "go", {"n": 1}))
        )
        sender.start()
        time.sleep(0.5)
        assert not result  # blocked behind the park
        parking.commit()
        sender.join(10)
    finally:
        parking.close()
    assert result == [True]  # it found the job parked for "go" and woke it
    assert services.claim("w-next", job.pk) is not None


def test_a_signal_committed_before_the_park_makes_the_parked_job_due_at_once():
    job, _ = services.submit("echo", {})
    lease = services.claim("w-park", job.pk)
    assert signals.signal_job(job.pk, "go", 1) is False  # the job runs: kept
    services.suspend(lease, reason=WaitReason.SIGNAL, key="go", until=BLOCKED_RUN_AT)
    parked = Job.objects.get(pk=job.pk)
    assert parked.status == "queued" and parked.run_at.year < 9999
    assert services.claim("w-next", job.pk) is not None
