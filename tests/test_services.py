"""The services: every write a compare-and-set that reports whether it held."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from jobs import exceptions, selectors, services
from jobs.models import Job, JobEvent
from tests.conftest import job_row
from tests.factories import JobFactory, raw

pytestmark = pytest.mark.django_db

W = "w-1"


def claimed(worker: str = W, **kw) -> services.Lease:
    job = JobFactory.create(**kw)
    lease = services.claim(worker, job.pk)
    assert lease is not None
    return lease


def stale_variants(lease: services.Lease) -> dict[str, services.Lease]:
    return {
        "old_lease_version": services.Lease(
            **{**_fields(lease), "lease_version": lease.lease_version - 1}
        ),
        "wrong_owner": services.Lease(**{**_fields(lease), "worker_id": "w-intruder"}),
    }


def _fields(lease: services.Lease) -> dict:
    return {f: getattr(lease, f) for f in services.Lease.__slots__}


# --- claiming ---------------------------------------------------------------------


def test_claim_bumps_lease_and_sets_owner():
    job = JobFactory.create()
    lease = services.claim(W, job.pk)
    row = job_row(job.pk)
    assert (row["status"], row["owned_by"], row["lease_version"]) == ("processing", W, 1)
    assert lease.lease_version == 1 and row["claimed_at"] is not None


@pytest.mark.parametrize("payload", ["hello", '{"not": "an object"}', "", 7, 1.5, True,
                                     [1, "two"], {"k": "v"}])  # fmt: skip
def test_a_claim_hands_over_every_json_payload_as_it_was_stored(payload):
    """The claim reads rows in binary, so a payload arrives parsed: a JSON string stays
    that string (parsing it again failed the whole claim, every job of it unclaimed)."""
    job = JobFactory.create(queue="strings", payload=payload)
    (lease,) = services.claim_next(W, ["strings"], 5)
    assert (lease.job_id, lease.payload) == (job.pk, payload)
    assert services.claim_ids("w-2", [JobFactory.create(payload=payload).pk])[0].payload == payload


def test_second_claim_of_same_job_is_a_duplicate():
    job = JobFactory.create()
    assert services.claim(W, job.pk) is not None
    assert services.claim("w-2", job.pk) is None
    assert job_row(job.pk)["owned_by"] == W


def test_claim_next_orders_by_priority_then_run_at_then_id():
    low = JobFactory.create(priority=-5)
    high = JobFactory.create(priority=50)
    mid1 = JobFactory.create(priority=0)
    mid2 = JobFactory.create(priority=0)
    leases = services.claim_next(W, ["default"], 10)
    by_id = {x.job_id for x in leases}
    assert by_id == {low.pk, high.pk, mid1.pk, mid2.pk}
    first = services.claim_next  # order check with limit 1 on fresh jobs
    a = JobFactory.create(priority=1)
    b = JobFactory.create(priority=9)
    assert [x.job_id for x in first(W, ["default"], 1)] == [b.pk]
    assert [x.job_id for x in first(W, ["default"], 1)] == [a.pk]


def test_claim_next_takes_earlier_queues_first():
    later = JobFactory.create(queue="bulk", priority=100)
    first = JobFactory.create(queue="urgent")
    leases = services.claim_next(W, ["urgent", "bulk"], 1)
    assert [x.job_id for x in leases] == [first.pk]
    assert [x.job_id for x in services.claim_next(W, ["urgent", "bulk"], 5)] == [later.pk]


def test_future_run_at_is_not_claimable():
    job = JobFactory.create()
    raw("UPDATE jobs_job SET run_at = now() + interval '1 hour' WHERE id = %s", [job.pk])
    assert services.claim_next(W, ["default"], 5) == []
    assert services.claim(W, job.pk) is None


# --- fencing: stale writes update nothing -------------------------------------------


@pytest.mark.parametrize("variant", ["old_lease_version", "wrong_owner", "not_processing"])
@pytest.mark.parametrize("op", ["heartbeat", "complete", "fail", "release"])
def test_stale_write_updates_zero_rows_and_leaves_row_unchanged(op, variant):
    lease = claimed()
    if variant == "not_processing":
        services.complete([(lease, {"first": True})])
        stale = lease
    else:
        # A second claim cycle leaves the row at a newer lease held by someone else.
        services.revoke([lease.job_id], actor="staff:t")
        newer = services.claim("w-2", lease.job_id)
        assert newer is not None
        stale = stale_variants(newer)[variant] if variant == "wrong_owner" else lease
    before = job_row(lease.job_id)
    if op == "heartbeat":
        assert services.heartbeat([stale]) == set()
    elif op == "complete":
        assert services.complete([(stale, {"stale": True})]) == {}
    elif op == "fail":
        assert services.fail([(stale, "stale error", False)]) == {}
    else:
        assert services.release([stale]) == set()
    assert job_row(lease.job_id) == before


def test_batch_with_one_stale_entry_completes_the_others_and_rejects_only_that_one():
    leases = [claimed() for _ in range(5)]
    services.revoke([leases[2].job_id], actor="staff:t")
    done = services.complete([(x, {"n": i}) for i, x in enumerate(leases)])
    assert set(done) == {x.job_id for i, x in enumerate(leases) if i != 2}
    assert job_row(leases[2].job_id)["status"] == "queued"
    for i, x in enumerate(leases):
        if i != 2:
            row = job_row(x.job_id)
            assert row["status"] == "done" and row["result"] == {"n": i}


def test_fail_batch_with_one_stale_entry_fails_the_others_and_rejects_only_that_one():
    leases = [claimed() for _ in range(5)]
    services.revoke([leases[1].job_id], actor="staff:t")
    items = [(x, f"boom {i}", i % 2 == 0) for i, x in enumerate(leases)]
    out = services.fail(items)
    assert set(out) == {x.job_id for i, x in enumerate(leases) if i != 1}
    stale = job_row(leases[1].job_id)
    assert (stale["status"], stale["retry_count"], stale["lease_version"]) == ("queued", 0, 2)
    assert stale["error"].startswith("lease revoked")
    for i, x in enumerate(leases):
        if i == 1:
            continue
        row = job_row(x.job_id)
        permanent = i % 2 == 0
        assert row["error"] == f"boom {i}"
        assert row["status"] == ("failed" if permanent else "queued")
        assert row["retry_count"] == (0 if permanent else 1)


def test_heartbeat_batch_with_one_stale_entry_extends_the_others_only():
    leases = [claimed() for _ in range(4)]
    for x in leases:
        _expire(x.job_id)
    services.revoke([leases[3].job_id], actor="staff:t")
    newer = services.claim("w-2", leases[3].job_id)
    assert newer is not None
    _expire(newer.job_id)
    assert services.heartbeat(leases) == {(x.job_id, x.lease_version) for x in leases[:3]}
    fresh = raw(
        "SELECT id FROM jobs_job WHERE heartbeat_at > now() - interval '5 seconds'"
        " AND id = ANY(%s)",
        [[x.job_id for x in leases]],
    )
    assert {r[0] for r in fresh} == {x.job_id for x in leases[:3]}
    row = job_row(newer.job_id)
    assert (row["owned_by"], row["lease_version"]) == ("w-2", 3)


def test_fence_rejection_is_recorded_with_both_lease_versions():
    lease = claimed()
    services.revoke([lease.job_id], actor="staff:t")
    services.claim("w-2", lease.job_id)
    services.record_fence_rejections([lease], "complete")
    event = JobEvent.objects.get(job_id=lease.job_id, kind="fence_rejected")
    assert event.lease_version == 1
    assert "held lease 1, row is at lease 3" in event.error


# --- retries ---------------------------------------------------------------------


def test_retryable_failure_requeues_with_backoff_and_bumped_lease():
    lease = claimed()
    out = services.fail([(lease, "flaky", False)])[lease.job_id]
    row = job_row(lease.job_id)
    assert out.status == "queued"
    assert (row["status"], row["retry_count"], row["lease_version"]) == ("queued", 1, 2)
    assert row["error"] == "flaky" and row["result"] is None and row["owned_by"] is None
    # Backoff 1 s base with jitter in [0.5, 1.0] × base for the first retry.
    delay = raw(
        "SELECT extract(epoch FROM run_at - now()) FROM jobs_job WHERE id = %s", [lease.job_id]
    )[0][0]
    assert 0.5 <= float(delay) <= 1.0


def test_budget_exhausted_after_max_retries_plus_one_attempts():
    job = JobFactory.create(max_retries=2)
    for attempt in range(3):
        raw("UPDATE jobs_job SET run_at = now() WHERE id = %s", [job.pk])
        lease = services.claim(W, job.pk)
        assert lease is not None, f"attempt {attempt + 1} not claimable"
        services.fail([(lease, f"boom {attempt}", False)])
    row = job_row(job.pk)
    assert (row["status"], row["retry_count"], row["error"]) == ("failed", 3, "boom 2")
    assert row["finished_at"] is not None


def test_permanent_failure_fails_at_once_without_spending_a_retry():
    lease = claimed()
    services.fail([(lease, "bad input", True)])
    row = job_row(lease.job_id)
    assert (row["status"], row["retry_count"]) == ("failed", 0)


def test_release_requeues_without_spending_a_retry():
    lease = claimed()
    assert services.release([lease]) == {lease.job_id}
    row = job_row(lease.job_id)
    assert (row["status"], row["retry_count"], row["lease_version"]) == ("queued", 0, 2)


# --- reaper services ----------------------------------------------------------------


def _expire(job_id: int, seconds: int = 60) -> None:
    raw(
        "UPDATE jobs_job SET heartbeat_at = now() - %s * interval '1 second' WHERE id = %s",
        [seconds, job_id],
    )


def test_reap_expired_requeues_and_fences_the_old_holder():
    lease = claimed()
    fresh = claimed()
    _expire(lease.job_id)
    out = services.reap_expired(15)
    assert set(out) == {lease.job_id}
    row = job_row(lease.job_id)
    assert (row["status"], row["retry_count"], row["lease_version"]) == ("queued", 1, 2)
    assert "lease expired" in row["error"]
    assert services.complete([(lease, "late")]) == {}
    assert job_row(fresh.job_id)["status"] == "processing"


def test_reap_expired_fails_when_budget_spent():
    job = JobFactory.create(max_retries=0)
    services.claim(W, job.pk)
    _expire(job.pk)
    assert services.reap_expired(15)[job.pk].status == "failed"
    assert job_row(job.pk)["status"] == "failed"


def test_repair_and_over_budget():
    parked = JobFactory.create(status="enqueue_failed")
    assert services.repair_enqueue_failed() == [parked.pk]
    assert job_row(parked.pk)["status"] == "queued"
    over = JobFactory.create(max_retries=0)
    raw("UPDATE jobs_job SET retry_count = 1 WHERE id = %s", [over.pk])
    assert set(services.fail_over_budget()) == {over.pk}
    row = job_row(over.pk)
    assert row["status"] == "failed" and "budget" in row["error"]


# --- staff and clients ---------------------------------------------------------------


def test_staff_retry_only_touches_failed_and_resets_budget():
    failed = JobFactory.create(status="failed")
    done = JobFactory.create(status="done")
    assert services.staff_retry([failed.pk, done.pk], "staff:ann") == [failed.pk]
    row = job_row(failed.pk)
    assert (row["status"], row["retry_count"], row["finished_at"]) == ("queued", 0, None)
    assert job_row(done.pk)["status"] == "done"
    assert JobEvent.objects.filter(job_id=failed.pk, actor="staff:ann").count() == 1


def _time_to_terminal_of_next_completion(job_id: int) -> float:
    lease = services.claim(W, job_id)
    assert lease is not None
    return services.complete([(lease, {"ok": True})])[job_id].time_to_terminal


def test_staff_retry_makes_the_job_due_now_for_the_slo():
    """SPEC §6 counts from when a job became due: a staff retry of a job submitted an
    hour ago and finished a moment later is a fast job, not an hour-long one."""
    job = JobFactory.create(status="failed")
    raw(
        "UPDATE jobs_job SET created_at = now() - interval '1 hour', "
        "finished_at = now() - interval '50 minutes' WHERE id = %s",
        [job.pk],
    )
    assert services.staff_retry([job.pk], "staff:ann") == [job.pk]
    assert 0 <= _time_to_terminal_of_next_completion(job.pk) < 25
    report = selectors.slo_report(window_seconds=3600, slo_seconds=25)
    assert (report.terminal, report.within_slo) == (1, 1)
    assert report.p99 < 25


def test_a_scheduled_job_is_measured_from_its_run_at():
    """due = max(created_at, run_at): a job scheduled an hour ahead is not late."""
    job, _ = services.submit("echo", {}, run_at=timezone.now() + timedelta(hours=1))
    # An hour passes: move every timestamp back together.
    raw(
        "UPDATE jobs_job SET created_at = created_at - interval '1 hour', "
        "run_at = run_at - interval '1 hour', "
        "due_at = due_at - interval '1 hour' WHERE id = %s",
        [job.pk],
    )
    assert 0 <= _time_to_terminal_of_next_completion(job.pk) < 25
    assert selectors.slo_report(window_seconds=3600, slo_seconds=25).within_slo == 1


def test_submit_and_submit_many_store_the_later_of_submission_and_run_at():
    later = timezone.now() + timedelta(hours=1)
    past = timezone.now() - timedelta(hours=1)
    single, _ = services.submit("echo", {}, run_at=later)
    many = services.submit_many(
        [services.NewJob("echo", {}), services.NewJob("echo", {}, run_at=later),
         services.NewJob("echo", {}, run_at=past)]
    )  # fmt: skip
    rows = [job_row(j) for j in (single.pk, *(m.job_id for m in many))]
    due = [r["due_at"] for r in rows]
    assert due == [later, rows[1]["created_at"], later, rows[3]["created_at"]]


def test_an_immediate_job_and_its_retries_count_from_submission():
    job, _ = services.submit("echo", {})
    row = job_row(job.pk)
    assert row["due_at"] == row["created_at"]  # due at submission
    raw(
        "UPDATE jobs_job SET created_at = now() - interval '40 seconds', "
        "due_at = now() - interval '40 seconds' WHERE id = %s",
        [job.pk],
    )
    lease = services.claim(W, job.pk)
    services.fail([(lease, "boom", False)])  # a retry keeps the job's due time
    raw("UPDATE jobs_job SET run_at = now() WHERE id = %s", [job.pk])
    assert _time_to_terminal_of_next_completion(job.pk) >= 40
    assert selectors.slo_report(window_seconds=3600, slo_seconds=25).within_slo == 0


def test_cancel_only_unstarted_and_only_own_client():
    from tests.factories import ClientFactory

    mine, theirs = ClientFactory.create(), ClientFactory.create()
    a = JobFactory.create(client_id=mine.pk)
    b = JobFactory.create(client_id=theirs.pk)
    c = JobFactory.create(client_id=mine.pk, status="processing")
    assert services.cancel([a.pk, b.pk, c.pk], "client:x", client_id=mine.pk) == [a.pk]
    row = job_row(a.pk)
    assert (row["status"], row["error"]) == ("failed", "cancelled")


def test_idempotency_key_same_request_returns_existing_other_request_conflicts():
    job, created = services.submit("echo", {"a": 1}, idempotency_key="k", request_hash="h1")
    again, created2 = services.submit("echo", {"a": 1}, idempotency_key="k", request_hash="h1")
    assert created and not created2 and again.pk == job.pk
    with pytest.raises(exceptions.IdempotencyConflict):
        services.submit("echo", {"a": 2}, idempotency_key="k", request_hash="h2")
    assert Job.objects.count() == 1


def test_history_records_every_transition_with_actor_and_lease():
    lease = claimed()
    services.fail([(lease, "x", False)])
    events = list(JobEvent.objects.filter(job_id=lease.job_id).order_by("id"))
    assert [(e.from_status, e.to_status, e.actor, e.lease_version) for e in events] == [
        (None, "queued", "app", 0),
        ("queued", "processing", f"worker:{W}", 1),
        ("processing", "queued", f"worker:{W}", 2),
    ]
    assert events[-1].error == "x"


# --- concurrency: real connections, real contention ------------------------------------


@pytest.mark.django_db(transaction=True)
def test_eight_threads_claim_500_jobs_exactly_once():
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO jobs_job (task, payload, queue, priority, max_retries, status, "
            "retry_count, lease_version, updated_by) "
            "SELECT 'echo', '{}', 'race', 0, 3, 'queued', 0, 0, 'test' "
            "FROM generate_series(1, 500)"
        )
    claims: list[tuple[str, int, int]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def run(n: int) -> None:
        worker = f"racer-{n}"
        try:
            start.wait()
            while True:
                got = services.claim_next(worker, ["race"], 7)
                if not got:
                    break
                with lock:
                    claims.extend((worker, x.job_id, x.lease_version) for x in got)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    ids = Counter(job_id for _, job_id, _ in claims)
    assert len(ids) == 500 and set(ids.values()) == {1}
    assert {lv for _, _, lv in claims} == {1}
    assert len({w for w, _, _ in claims}) > 1, "contention never happened"
    rows = raw(
        "SELECT count(*), min(lease_version), max(lease_version) FROM jobs_job "
        "WHERE queue = 'race' AND status = 'processing'"
    )
    assert rows == [(500, 1, 1)]


# --- bulk submission -------------------------------------------------------------------


def _queued_ids() -> list[int]:
    from jobs.transport import get_transport

    t = get_transport()
    return [int(x) for x in t._client.lrange(t.key("default"), 0, -1)]


@pytest.mark.django_db(transaction=True)
def test_submit_many_inserts_in_order_and_signals_after_commit():
    from django.db import transaction

    items = [services.NewJob("echo", {"n": i}, priority=i) for i in range(5)]
    items.append(services.NewJob("echo", {"later": True}, run_at=_in_one_hour()))
    with transaction.atomic():
        out = services.submit_many(items)
        assert _queued_ids() == []  # nothing is signalled before commit
    assert [o.created for o in out] == [True] * 6
    rows = {r[0]: r for r in raw("SELECT id, payload, priority, status FROM jobs_job")}
    assert len(rows) == 6
    for i, o in enumerate(out[:5]):
        assert rows[o.job_id][2] == i and o.status == "queued"
    # Due jobs are pushed once, in one round trip; the scheduled one is not pushed early.
    assert _queued_ids() == [o.job_id for o in out[:5]]
    events = JobEvent.objects.filter(job_id__in=[o.job_id for o in out], to_status="queued")
    assert events.count() == 6


def _in_one_hour():
    from datetime import UTC, datetime, timedelta

    return datetime.now(UTC) + timedelta(hours=1)


def test_submit_many_idempotent_replay_returns_existing_and_conflict_writes_nothing():
    first = services.submit_many(
        [
            services.NewJob("echo", {"a": 1}, idempotency_key="k1", request_hash="h1"),
            services.NewJob("echo", {"b": 2}),
        ]
    )
    assert [o.created for o in first] == [True, True]
    replay = services.submit_many(
        [
            services.NewJob("echo", {"c": 3}),
            services.NewJob("echo", {"a": 1}, idempotency_key="k1", request_hash="h1"),
        ]
    )
    assert replay[1].job_id == first[0].job_id and not replay[1].created
    assert replay[0].created
    before = Job.objects.count()
    with pytest.raises(exceptions.BatchIdempotencyConflict) as err:
        services.submit_many(
            [
                services.NewJob("echo", {"d": 4}),
                services.NewJob("echo", {"a": 9}, idempotency_key="k1", request_hash="h9"),
            ]
        )
    assert err.value.conflicts == {1: first[0].job_id}
    assert Job.objects.count() == before  # the other item was rolled back with it


def test_submit_many_same_key_twice_in_one_batch():
    same = services.submit_many(
        [
            services.NewJob("echo", {}, idempotency_key="dup", request_hash="h"),
            services.NewJob("echo", {}, idempotency_key="dup", request_hash="h"),
        ]
    )
    assert same[0].created and not same[1].created and same[0].job_id == same[1].job_id
    with pytest.raises(exceptions.BatchIdempotencyConflict):
        services.submit_many(
            [
                services.NewJob("echo", {}, idempotency_key="dup2", request_hash="h1"),
                services.NewJob("echo", {}, idempotency_key="dup2", request_hash="h2"),
            ]
        )
    assert not Job.objects.filter(idempotency_key="dup2").exists()


def test_submit_many_keys_are_per_client():
    from tests.factories import ClientFactory

    a, b = ClientFactory.create(), ClientFactory.create()
    item = services.NewJob("echo", {}, idempotency_key="k", request_hash="h")
    ja = services.submit_many([item], client_id=a.pk)[0]
    jb = services.submit_many([item], client_id=b.pk)[0]
    assert ja.created and jb.created and ja.job_id != jb.job_id
    assert services.submit_many([item], client_id=a.pk)[0].job_id == ja.job_id


def test_submit_many_rejected_by_the_database_writes_nothing():
    from django.db import IntegrityError

    with pytest.raises(IntegrityError):
        services.submit_many(
            [services.NewJob("echo", {}), services.NewJob("echo", {}, priority=1000)]
        )
    assert Job.objects.count() == 0
