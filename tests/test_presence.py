"""The worker registry and dead-owner detection in-process against real PostgreSQL."""

from __future__ import annotations

import pytest
from django.db import connection

from jobs import services
from jobs.models import JobEvent, WorkerProcess
from jobs.presence import Presence
from tests.conftest import job_row
from tests.factories import raw
from tests.harness import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def _session():
    conn = connection.get_new_connection(connection.get_connection_params())
    conn.autocommit = True
    return conn


def _register(worker_id: str, *, lock: bool) -> tuple[object, bool]:
    conn = _session()
    locked = services.worker_beat(
        conn,
        worker_id,
        hostname="h",
        pid=1,
        queues=["default"],
        concurrency=1,
        lock=lock,
        locked=False,
    )
    return conn, locked


def _stale(worker_id: str, seconds: float = 10) -> None:
    raw(
        "UPDATE jobs_worker SET heartbeat_at = now() - %s * interval '1 second' WHERE id = %s",
        [seconds, worker_id],
    )


def test_jobs_of_a_worker_whose_session_ended_are_requeued_once_with_the_lease_bumped():
    services.submit("echo", {})
    conn, locked = _register("w-dead", lock=True)
    assert locked
    (lease,) = services.claim_next("w-dead", ["default"], 1)
    conn.close()  # the process is gone: its session and lock with it
    assert services.reap_gone_owners(2.0) == {}  # its row is fresh: within the grace
    _stale("w-dead")
    # The server ends the session a moment after the client closes it.
    reaped = wait_until(lambda: services.reap_gone_owners(2.0), 5, message="reaped")
    assert list(reaped) == [lease.job_id]
    row = job_row(lease.job_id)
    assert (row["status"], row["retry_count"], row["lease_version"]) == ("queued", 1, 2)
    assert row["error"] == "worker gone: the session of w-dead ended"
    assert services.reap_gone_owners(2.0) == {}
    # The dead worker's late write is fenced off.
    assert services.complete([(lease, {"late": True})]) == {}
    assert JobEvent.objects.filter(job_id=lease.job_id, actor="reaper").count() == 1
    assert services.forget_workers(2.0, 30.0) == 1
    assert not WorkerProcess.objects.filter(id="w-dead").exists()


def test_a_live_session_a_frozen_worker_or_no_lock_keeps_the_jobs():
    services.submit("echo", {})
    services.submit("echo", {})
    live, _ = _register("w-live", lock=True)  # frozen: session alive, beats stale
    nolock, locked = _register("w-nolock", lock=False)  # detection off: lease only
    assert not locked
    services.claim_next("w-live", ["default"], 1)
    services.claim_next("w-nolock", ["default"], 1)
    nolock.close()
    _stale("w-live")
    _stale("w-nolock")
    assert services.reap_gone_owners(2.0) == {}
    assert WorkerProcess.objects.get(id="w-nolock").lock_key is None
    live.close()
    reaped = wait_until(lambda: services.reap_gone_owners(2.0), 5, message="reaped")
    assert len(reaped) == 1


def test_presence_registers_reconnects_and_leaves():
    p = Presence("w-presence", ["a", "*"], 3, interval=0.1, lock=True)
    p.start()
    row = WorkerProcess.objects.get(id="w-presence")
    assert (row.queues, row.concurrency, row.lock_key) == (
        ["a", "*"],
        3,
        services.presence_lock_key("w-presence"),
    )
    first = row.backend_pid
    raw("SELECT pg_terminate_backend(%s)", [first])
    wait_until(
        lambda: WorkerProcess.objects.get(id="w-presence").backend_pid != first,
        10,
        message="re-registered",
    )
    wait_until(lambda: p.locked, 5, message="relocked")
    _stale("w-presence", 0)
    assert services.reap_gone_owners(0.0) == {}
    p.stop()
    assert not WorkerProcess.objects.filter(id="w-presence").exists()


def test_consumer_gauges_count_live_workers_per_queue_and_star_workers_for_all():
    from jobs.collectors import ConsumersCollector, DepthCollector

    for queue in ("served", "orphan", "orphan"):
        services.submit("echo", {}, queue=queue)
    conn, _ = _register("w-served", lock=False)
    raw("UPDATE jobs_worker SET queues = '{served}' WHERE id = 'w-served'")
    collector = ConsumersCollector(DepthCollector(cache_seconds=0))
    got = {f.name: {s.labels["queue"]: s.value for s in f.samples} for f in collector.collect()}
    assert got["jobs_queue_consumers"] == {"served": 1, "orphan": 0}
    assert got["jobs_unserved_queue_depth"] == {"served": 0, "orphan": 2}
    star, _ = _register("w-star", lock=False)
    raw("UPDATE jobs_worker SET queues = '{*}' WHERE id = 'w-star'")
    got = {f.name: {s.labels["queue"]: s.value for s in f.samples} for f in collector.collect()}
    assert got["jobs_queue_consumers"] == {"served": 2, "orphan": 1}
    assert got["jobs_unserved_queue_depth"] == {"served": 0, "orphan": 0}
    _stale("w-star", 3600)  # silent for longer than a lease: not a consumer any more
    got = {f.name: {s.labels["queue"]: s.value for s in f.samples} for f in collector.collect()}
    assert got["jobs_unserved_queue_depth"]["orphan"] == 2
    conn.close()
    star.close()
