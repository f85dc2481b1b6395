"""The fault suite's checker cannot pass vacuously: each invariant is shown to fail
on rows and histories a broken build would leave behind.

The broken builds are real writes to the test database: a copy of the worker's
completion without the fence predicate (a stale worker's UPDATE), and writes made
with the lifecycle guard dropped inside the test's transaction (rolled back with it).
"""

from __future__ import annotations

import json

import pytest
from django.db import connection, transaction

from chaos import checks
from demo.models import Effect
from jobs import services
from jobs.models import Job
from tests.factories import JobFactory, raw

pytestmark = pytest.mark.django_db

A, B = "w-stale", "w-fresh"


# --- building blocks ------------------------------------------------------------------


def run(check, accepted=()) -> list[checks.Violation]:
    return check(connection, frozenset(accepted))


def drop_guard() -> None:
    """The broken build: no lifecycle trigger (restored when the test's transaction ends)."""
    raw("DROP TRIGGER jobs_job_guard ON jobs_job")


class _Rejected(Exception):
    pass


def record_done(lease: services.Lease) -> bool:
    """What the worker does for demo.record: effect + fenced completion, one transaction."""
    try:
        with transaction.atomic():
            Effect.objects.create(
                job_id=lease.job_id, lease_version=lease.lease_version, worker_id=lease.worker_id
            )
            result = {"recorded_by": lease.worker_id, "lease_version": lease.lease_version}
            if lease.job_id not in services.complete([(lease, result)]):
                raise _Rejected
    except _Rejected:
        services.record_fence_rejections([lease], "complete")
        return False
    return True


def complete_without_fence(lease: services.Lease) -> None:
    """services.complete minus its fence predicate, with the effect: a stale writer wins."""
    Effect.objects.create(
        job_id=lease.job_id, lease_version=lease.lease_version, worker_id=lease.worker_id
    )
    raw(
        """UPDATE jobs_job SET status = 'done', result = %s::jsonb, error = NULL,
               owned_by = NULL, claimed_at = NULL, heartbeat_at = NULL,
               finished_at = now(), updated_by = %s
           WHERE id = %s""",
        [
            json.dumps({"recorded_by": lease.worker_id, "lease_version": lease.lease_version}),
            services.worker_actor(lease.worker_id),
            lease.job_id,
        ],
    )


def expire(job_id: int) -> None:
    raw("UPDATE jobs_job SET heartbeat_at = now() - interval '1 hour' WHERE id = %s", [job_id])
    assert job_id in services.reap_expired(60)


def stale_and_fresh(task: str = "demo.record") -> tuple[services.Lease, services.Lease]:
    """A claims, its lease expires and is reaped, B claims: A is now a stale writer."""
    job = JobFactory.create(task=task)
    stale = services.claim(A, job.pk)
    expire(job.pk)
    fresh = services.claim(B, job.pk)
    assert (stale.lease_version, fresh.lease_version) == (1, 3)
    return stale, fresh


def names(found: list[checks.Violation]) -> set[str]:
    return {v.check for v in found}


# --- a correct build passes every check ------------------------------------------------


def test_histories_from_the_real_services_pass_every_check():
    stale, fresh = stale_and_fresh()
    assert record_done(fresh)
    assert not record_done(stale)  # fenced off: effect rolled back, rejection recorded
    assert Effect.objects.filter(job_id=fresh.job_id).count() == 1
    done = JobFactory.create(status="done")
    permanent = JobFactory.create(task="demo.permanent")
    services.fail([(services.claim(A, permanent.pk), "PermanentError: no", True)])
    spent = JobFactory.create(task="fail", max_retries=0)
    services.fail([(services.claim(A, spent.pk), "RetryableError: again", False)])
    retried = JobFactory.create(task="demo.flaky")
    services.fail([(services.claim(A, retried.pk), "RetryableError: flaky", False)])
    raw("UPDATE jobs_job SET run_at = now() WHERE id = %s", [retried.pk])
    assert services.complete([(services.claim(B, retried.pk), {"attempt": 2})])
    cancelled = JobFactory.create()
    services.cancel([cancelled.pk], actor="client:c")
    parked = JobFactory.create(status="enqueue_failed")
    services.repair_enqueue_failed(job_ids=[parked.pk])
    assert services.complete([(services.claim(B, parked.pk), None)])
    accepted = [stale.job_id, done.pk, permanent.pk, spent.pk, retried.pk, cancelled.pk, parked.pk]

    found = checks.run_all(connection, accepted)

    assert found == {name: [] for name in checks.CHECKS}
    lat = checks.latency(connection, accepted)
    assert (lat.jobs, lat.terminal, lat.done, lat.failed) == (7, 7, 4, 3)


# --- 1. lost or stuck -----------------------------------------------------------------


def test_lost_job_is_reported():
    kept = JobFactory.create(status="done")
    found = run(checks.lost_or_stuck, [kept.pk, 987654321])
    assert [(v.job_id, "lost" in v.detail) for v in found] == [(987654321, True)]


@pytest.mark.parametrize("status", ["queued", "processing", "enqueue_failed"])
def test_unfinished_job_is_reported_as_stuck(status):
    job = JobFactory.create(status=status)
    found = run(checks.lost_or_stuck, [job.pk])
    assert [(v.job_id, f"left {status}" in v.detail) for v in found] == [(job.pk, True)]


def test_unacknowledged_rows_must_finish_too():
    job = JobFactory.create()  # committed, but the client never saw a reply
    found = run(checks.lost_or_stuck, [])
    assert [v.job_id for v in found] == [job.pk] and "unacknowledged" in found[0].detail


# --- 2. exactly-once effects ------------------------------------------------------------


def test_fenceless_stale_write_after_the_fresh_one_shows_a_double_effect():
    stale, fresh = stale_and_fresh()
    assert record_done(fresh)
    complete_without_fence(stale)  # done → done is no transition: the guard lets it through

    found = run(checks.effects_at_most_once)

    assert [(v.job_id, v.detail) for v in found] == [
        (fresh.job_id, "2 committed effects (at most 1 allowed)")
    ]
    wrong = run(checks.results_under_final_lease)
    assert {v.job_id for v in wrong} == {fresh.job_id}
    assert any("result written under lease 1, final is 3" in v.detail for v in wrong)


def test_effect_of_a_job_that_did_not_finish_is_reported():
    job = JobFactory.create(task="demo.record")
    lease = services.claim(A, job.pk)
    Effect.objects.create(job_id=job.pk, lease_version=lease.lease_version, worker_id=A)
    services.fail([(lease, "RuntimeError: after the effect", True)])  # effect not rolled back
    found = run(checks.effects_at_most_once)
    assert [v.detail for v in found] == ["effect committed but the job is failed"]


def test_done_record_job_without_its_effect_is_reported():
    job = JobFactory.create(task="demo.record")
    services.complete([(services.claim(A, job.pk), {"lease_version": 1, "recorded_by": A})])
    found = run(checks.effects_at_most_once)
    assert [(v.job_id, v.detail) for v in found] == [
        (job.pk, "done demo.record job without its effect")
    ]


def test_done_twice_in_the_history_is_reported():
    job = JobFactory.create(status="done")
    drop_guard()
    raw("UPDATE jobs_job SET status = 'processing', owned_by = 'w', claimed_at = now(), "
        "heartbeat_at = now(), finished_at = NULL WHERE id = %s", [job.pk])  # fmt: skip
    raw("UPDATE jobs_job SET status = 'done', owned_by = NULL, claimed_at = NULL, "
        "heartbeat_at = NULL, finished_at = now() WHERE id = %s", [job.pk])  # fmt: skip
    found = run(checks.done_exactly_once)
    assert [(v.job_id, v.detail) for v in found] == [(job.pk, "2 transitions to done, job is done")]


def test_done_then_failed_is_reported():
    job = JobFactory.create(status="done")
    drop_guard()
    raw("UPDATE jobs_job SET status = 'failed', error = 'late' WHERE id = %s", [job.pk])
    found = run(checks.done_exactly_once)
    assert [v.detail for v in found] == ["1 transitions to done, job is failed"]


# --- 3. the final write is the final lease holder's ------------------------------------------


def test_fenceless_stale_write_while_the_fresh_worker_runs_wins_and_is_reported():
    """The stale worker completes first; the fresh worker is then turned away."""
    stale, fresh = stale_and_fresh()
    complete_without_fence(stale)  # processing → done is legal: only the fence could stop it
    assert not record_done(fresh)

    found = run(checks.results_under_final_lease)

    details = [v.detail for v in found]
    assert f"done written by 'worker:{A}', but lease 3 belongs to 'worker:{B}'" in details
    assert "result written under lease 1, final is 3" in details
    assert f"result recorded by {A}, lease held by {B}" in details
    assert f"effect written under lease 1 by {A}; final lease 3 held by {B}" in details
    assert run(checks.effects_at_most_once) == []  # one effect — just the wrong one


def test_stale_write_of_a_task_without_effects_is_caught_by_its_actor():
    stale, fresh = stale_and_fresh(task="echo")
    raw("UPDATE jobs_job SET status = 'done', result = '1', error = NULL, owned_by = NULL, "
        "claimed_at = NULL, heartbeat_at = NULL, finished_at = now(), updated_by = %s "
        "WHERE id = %s",
        [services.worker_actor(A), stale.job_id])  # fmt: skip
    found = run(checks.results_under_final_lease)
    assert [v.job_id for v in found] == [stale.job_id]


def test_done_without_any_claim_at_its_lease_is_reported():
    job = JobFactory.create()
    drop_guard()
    raw("UPDATE jobs_job SET status = 'done', finished_at = now(), lease_version = 5 "
        "WHERE id = %s", [job.pk])  # fmt: skip
    found = run(checks.results_under_final_lease)
    assert [v.detail for v in found] == ["done, but nobody claimed lease 5"]


# --- 4. lease_version never decreases ---------------------------------------------------------


def test_lease_decrease_in_the_history_is_reported():
    stale, fresh = stale_and_fresh()
    drop_guard()
    raw("UPDATE jobs_job SET status = 'queued', lease_version = 2, owned_by = NULL, "
        "claimed_at = NULL, heartbeat_at = NULL WHERE id = %s", [fresh.job_id])  # fmt: skip
    found = run(checks.lease_never_decreases)
    assert [v.detail for v in found] == [
        "lease_version went 3 → 2 (to queued)",
        "row at lease 2, history reached 3",
    ]


def test_row_behind_its_history_is_reported():
    job = JobFactory.create(status="done")
    drop_guard()
    raw("UPDATE jobs_job SET lease_version = 0 WHERE id = %s", [job.pk])  # no status change
    found = run(checks.lease_never_decreases)
    assert [v.detail for v in found] == ["row at lease 0, history reached 1"]


def test_rejecting_the_current_lease_holder_is_reported():
    """An over-eager fence: the rejected write held the lease that was still current."""
    job = JobFactory.create()
    lease = services.claim(A, job.pk)
    services.record_fence_rejections([lease], "complete")
    found = run(checks.lease_never_decreases)
    assert len(found) == 1 and "while that lease was current" in found[0].detail


def test_rejecting_a_superseded_lease_is_fine():
    stale, fresh = stale_and_fresh()
    services.record_fence_rejections([stale], "heartbeat")
    assert run(checks.lease_never_decreases) == []


# --- 5. legal transitions and a complete history ----------------------------------------------


def test_illegal_transition_is_reported():
    job = JobFactory.create()
    drop_guard()
    raw("UPDATE jobs_job SET status = 'done', finished_at = now() WHERE id = %s", [job.pk])
    found = run(checks.transitions_legal)
    assert [v.detail for v in found] == ["illegal transition queued → done"]


def test_claim_without_a_lease_bump_is_reported():
    job = JobFactory.create()
    drop_guard()
    raw("UPDATE jobs_job SET status = 'processing', owned_by = 'w', claimed_at = now(), "
        "heartbeat_at = now() WHERE id = %s", [job.pk])  # fmt: skip
    found = run(checks.transitions_legal)
    assert [v.detail for v in found] == ["queued → processing without a lease bump (0)"]


def test_gap_in_the_history_is_reported():
    job = JobFactory.create(status="done")
    raw("DELETE FROM jobs_jobevent WHERE job_id = %s AND to_status = 'processing'", [job.pk])
    found = run(checks.transitions_legal)
    assert [v.detail for v in found] == ["gap in history: was queued, next step processing → done"]


def test_history_that_does_not_end_where_the_row_is_is_reported():
    job = JobFactory.create(status="done")
    raw("DELETE FROM jobs_jobevent WHERE job_id = %s AND to_status = 'done'", [job.pk])
    found = run(checks.transitions_legal)
    assert [v.detail for v in found] == ["history ends at processing, row is done"]


def test_manual_retry_by_anyone_but_staff_is_reported():
    job = JobFactory.create(status="failed")
    services.staff_retry([job.pk], actor="reaper")
    found = run(checks.transitions_legal)
    assert [v.detail for v in found] == ["failed → queued by 'reaper'"]
    # ...while a staff retry is legal (and then the job must still finish).
    other = JobFactory.create(status="failed")
    services.staff_retry([other.pk], actor="staff:alice")
    assert [v.job_id for v in run(checks.transitions_legal)] == [job.pk]


def test_row_without_history_is_reported():
    job = JobFactory.create()
    raw("DELETE FROM jobs_jobevent WHERE job_id = %s", [job.pk])
    found = run(checks.transitions_legal)
    assert [v.detail for v in found] == ["job is queued with no history"]


# --- 6. failures are justified ----------------------------------------------------------------


def test_failing_with_budget_left_is_reported():
    """A fail() that forgot the budget: a retryable error ends the job at once."""
    job = JobFactory.create(task="demo.flaky", max_retries=3)
    services.fail([(services.claim(A, job.pk), "RetryableError: try again", True)])
    found = run(checks.failures_justified)
    assert len(found) == 1 and "failed with budget left (0 of 3 retries)" in found[0].detail


def test_done_past_its_budget_is_reported():
    job = JobFactory.create(max_retries=0)
    lease = services.claim(A, job.pk)
    raw("UPDATE jobs_job SET retry_count = 2 WHERE id = %s", [job.pk])  # a bookkeeping bug
    services.complete([(lease, None)])
    found = run(checks.failures_justified)
    assert [v.detail for v in found] == ["done after 2 retries, budget 0"]


def test_task_that_always_fails_reported_done():
    job = JobFactory.create(task="demo.permanent")
    services.complete([(services.claim(A, job.pk), None)])
    found = run(checks.failures_justified)
    assert [v.detail for v in found] == ["'demo.permanent' can never succeed, but is done"]


def test_permanent_error_from_a_task_that_cannot_raise_it_is_reported():
    job = JobFactory.create(task="echo")
    services.fail([(services.claim(A, job.pk), "PermanentError: from nowhere", True)])
    found = run(checks.failures_justified)
    assert len(found) == 1 and found[0].detail.startswith("'echo' failed with")


# --- latency -------------------------------------------------------------------------------------


# --- 7. crash charges only started attempts -----------------------------------------------


def _charge_like_the_old_reaper(job_id: int, status: str, error: str) -> None:
    """D68's recovery: a retry spent whether or not the attempt started."""
    raw(
        """UPDATE jobs_job SET retry_count = retry_count + 1, status = %s,
               lease_version = lease_version + 1, error = %s, owned_by = NULL,
               claimed_at = NULL, heartbeat_at = NULL, updated_by = 'reaper',
               finished_at = CASE WHEN %s = 'failed' THEN now() END
           WHERE id = %s""",
        [status, error, status, job_id],
    )


def test_crash_recovery_of_real_services_charges_only_started_attempts():
    job = JobFactory.create(task="echo", max_retries=0)
    services.claim_next(A, [job.queue], 1, start=0)  # prefetched: never started
    expire(job.pk)
    services.claim_next(B, [job.queue], 1)  # started by its claim
    expire(job.pk)
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.retry_count) == ("failed", 1)
    assert run(checks.crash_charges_started) == []


def test_failing_an_attempt_that_never_started_on_a_crash_is_reported():
    job = JobFactory.create(task="echo", max_retries=0)
    services.claim_next(A, [job.queue], 1, start=0)
    _charge_like_the_old_reaper(job.pk, "failed", "worker gone: the session of w-stale ended")
    found = run(checks.crash_charges_started)
    assert [(v.check, v.job_id) for v in found] == [("crash_charges_started", job.pk)]


def test_a_retry_spent_on_a_requeue_marked_not_started_is_reported():
    job = JobFactory.create(task="echo", max_retries=3)
    services.claim_next(A, [job.queue], 1, start=0)
    _charge_like_the_old_reaper(job.pk, "queued", f"lease expired; {checks.NOT_STARTED}")
    found = run(checks.crash_charges_started)
    assert [(v.check, v.job_id) for v in found] == [("crash_charges_started", job.pk)]


def test_latency_percentiles_and_share_within_the_slo():
    ids = []
    for seconds in [1, 2, 3, 4, 5, 6, 7, 8, 30, 40]:
        job = JobFactory.create(status="done")
        raw("UPDATE jobs_job SET created_at = finished_at - %s * interval '1 second' "
            "WHERE id = %s", [seconds, job.pk])  # fmt: skip
        ids.append(job.pk)
    unfinished = JobFactory.create()
    lat = checks.latency(connection, [*ids, unfinished.pk], slo_seconds=25)
    assert (lat.jobs, lat.terminal, lat.within_slo) == (11, 10, 8)
    assert (lat.p50, lat.p95, lat.p99, lat.max) == (5.0, 40.0, 40.0, 40.0)
    assert lat.share_within_slo == pytest.approx(8 / 11)  # the unfinished job counts as late


def test_checks_read_a_plain_psycopg_connection_too():
    """The harness passes psycopg connections (JSON decoded, arrays as lists), not Django's."""
    import psycopg

    s = connection.settings_dict
    url = f"postgresql://{s['USER']}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"
    with psycopg.connect(url) as other:  # sees only committed rows, none of this test's
        found = checks.run_all(other, [424242])
    assert set(found) == set(checks.CHECKS)
    assert [v.job_id for v in found["lost_or_stuck"]] == [424242]


# --- 8. durable steps and workflows ------------------------------------------------------


def _diamond(on_failure: str = "fail_dependents") -> dict[str, int]:
    from jobs import workflows
    from jobs.models import WorkflowNode

    wf = workflows.Workflow("diamond", on_failure=on_failure)
    wf.step("a", "echo").step("b", "echo", after=["a"]).step("c", "echo", after=["a"])
    wf.step("d", "echo", after=["b", "c"])
    workflow_id = wf.submit()
    return dict(WorkflowNode.objects.filter(workflow_id=workflow_id).values_list("key", "job_id"))


def _checkpoint(lease: services.Lease, name: str) -> bool:
    return services.checkpoint_step(lease, name, json.dumps({"n": name}))


def test_steps_and_workflows_from_the_real_services_pass():
    ids = _diamond()
    first = services.claim(A, ids["a"])
    assert _checkpoint(first, "s1")
    services.revoke([ids["a"]], actor="staff:t")
    assert not _checkpoint(first, "s2")  # fenced off: nothing written
    again = services.claim(B, ids["a"])
    assert _checkpoint(again, "s2")
    assert services.complete([(again, 1)])
    for key in ("b", "c", "d"):
        assert services.complete([(services.claim(B, ids[key]), key)])
    found = checks.run_all(connection, ids.values())
    assert found == {name: [] for name in checks.CHECKS}


def test_a_checkpoint_by_a_worker_that_never_held_the_lease_is_reported():
    job = JobFactory.create()
    lease = services.claim(A, job.pk)
    raw("""INSERT INTO jobs_jobstep (job_id, name, result, lease_version, worker_id, created_at)
           VALUES (%s, 'x', '1', %s, %s, statement_timestamp())""",
        [job.pk, lease.lease_version, B])  # fmt: skip
    assert [v.check for v in run(checks.steps_under_held_lease)] == ["steps_under_held_lease"]


def test_a_fenceless_checkpoint_after_the_lease_ended_is_reported():
    job = JobFactory.create()
    stale = services.claim(A, job.pk)
    services.revoke([job.pk], actor="staff:t")
    # The broken build: the checkpoint's INSERT without the fence, seconds later.
    raw("""INSERT INTO jobs_jobstep (job_id, name, result, lease_version, worker_id, created_at)
           VALUES (%s, 'late', '1', %s, %s, statement_timestamp() + interval '5 seconds')""",
        [job.pk, stale.lease_version, A])  # fmt: skip
    found = run(checks.steps_under_held_lease)
    assert len(found) == 1 and "outside its lease" in found[0].detail


def test_a_child_claimed_before_its_parent_ended_is_reported():
    ids = _diamond()
    services.complete([(services.claim(A, ids["a"]), 1)])
    services.claim(A, ids["b"])  # b still runs
    # The broken build: d made due without waiting for b.
    raw("UPDATE jobs_job SET run_at = now() WHERE id = %s", [ids["d"]])
    assert services.claim(A, ids["d"]) is not None
    found = run(checks.children_after_parents)
    assert found and all(v.job_id == ids["d"] for v in found)
    assert any("before parent" in v.detail for v in found)


def test_a_child_that_ran_after_a_failed_parent_under_fail_dependents_is_reported():
    ids = _diamond("continue")
    services.fail([(services.claim(A, ids["a"]), "PermanentError: no", True)])
    services.complete([(services.claim(A, ids["b"]), 1)])
    assert run(checks.children_after_parents) == []  # continue: b may run
    raw("UPDATE jobs_workflow SET on_failure = 'fail_dependents'")  # as if it had not
    found = run(checks.children_after_parents)
    assert [(v.job_id, "fail_dependents" in v.detail) for v in found] == [(ids["b"], True)]


def test_a_detached_period_table_is_reported():
    raw("CREATE TABLE jobs_job_p20200106 (LIKE jobs_job)")
    assert [str(v) for v in run(checks.partitions_whole)] == [
        "[partitions_whole] jobs_job_p20200106 is detached"
    ]


@pytest.mark.django_db(transaction=True)
def test_a_partition_left_detach_pending_is_reported():
    """An interrupted DETACH … CONCURRENTLY of the next period's job partition, made for
    real; put back afterwards."""
    from datetime import UTC, datetime

    from harness import database_url, interrupt_detach
    from jobs import partitions

    partitions.ensure_ahead()
    table = partitions.partition_name(
        "jobs_job", partitions.next_start(partitions.period_start(datetime.now(UTC)))
    )
    assert run(checks.partitions_whole) == []
    interrupt_detach(database_url(), "jobs_job", table)
    try:
        assert [str(v) for v in run(checks.partitions_whole)] == [
            f"[partitions_whole] {table} is detach pending"
        ]
    finally:
        assert partitions.attach_pending_detaches() == 1
    assert run(checks.partitions_whole) == []


def _sequence(n: int = 3) -> list[int]:
    return [services.submit("echo", {}, sequence_key="s")[0].pk for _ in range(n)]


def test_a_sequence_run_one_at_a_time_in_order_passes():
    ids = _sequence()
    for job_id in ids:
        services.complete([(services.claim(A, job_id), 1)])
    assert run(checks.sequences_serial) == []


def test_overlapping_or_reordered_jobs_of_a_sequence_are_reported():
    ids = _sequence()
    services.claim(A, ids[0])  # still runs
    # The broken build: the third job made due at once, run before the second.
    raw("UPDATE jobs_job SET run_at = now() WHERE id = %s", [ids[2]])
    assert services.claim(B, ids[2]) is not None
    found = run(checks.sequences_serial)
    assert found and all(v.job_id == ids[2] for v in found)
    assert any("while job" in v.detail for v in found)


def test_a_chain_of_runs_from_the_real_services_passes_and_a_lost_run_is_reported():
    job = JobFactory.create()
    second = services.continue_as_new(services.claim(A, job.pk), '{"run": 2}')
    third = services.continue_as_new(services.claim(B, second), '{"run": 3}')
    assert services.complete([(services.claim(A, third), 1)])
    assert run(checks.chains_whole) == []
    raw("UPDATE jobs_job SET run_number = 4 WHERE id = %s", [third])  # the broken build
    found = run(checks.chains_whole)
    assert [v.check for v in found] == ["chains_whole"] and "lost or doubled" in found[0].detail


def _debounced(n: int, key: str = "k") -> services.Lease | None:
    from jobs.submission import submit

    payload = {"n": n, checks.DEBOUNCE_MARK: key}
    return submit("echo", payload, debounce_key=key, debounce_seconds=30)[0]


def test_debounced_jobs_made_one_after_another_start_pass():
    first = _debounced(1)
    assert _debounced(2).pk == first.pk  # joined
    raw("UPDATE jobs_job SET run_at = now() WHERE id = %s", [first.pk])
    services.complete([(services.claim(A, first.pk), 1)])
    second = _debounced(3)  # the first started: a new job
    assert second.pk != first.pk and _debounced(4).pk == second.pk
    assert run(checks.debounce_gathers) == []


def test_a_second_waiting_job_of_a_debounce_key_is_reported():
    first = _debounced(1)
    # The broken build: a submission of the key that made a job instead of joining.
    other = services.submit("echo", {"n": 2, checks.DEBOUNCE_MARK: "k"})[0]
    _debounced(3, key="another")
    found = run(checks.debounce_gathers)
    assert [(v.check, v.job_id) for v in found] == [("debounce_gathers", other.pk)]
    assert f"job {first.pk}" in found[0].detail


def _throttle(key_rate: dict | None) -> None:
    from jobs import queuecontrol

    queuecontrol.sync({"default": {}, "crm": {"key_rate": key_rate} if key_rate else {}})


def _keyed(n: int, key: str = "acct") -> list[int]:
    return [services.submit("echo", {}, queue="crm", concurrency_key=key)[0].pk for _ in range(n)]


def test_starts_within_a_keys_rate_pass():
    _throttle({"limit": 2, "period": 60})
    _keyed(3)
    _keyed(1, "other")
    gated = services.claim_limited_under_queue_lock(A, "crm", 10)
    assert len(gated.leases) == 3  # two of acct, one of other; the third of acct waits
    assert run(checks.key_rate_held) == []


def test_a_key_started_past_its_rate_is_reported():
    ids = _keyed(3)
    _throttle(None)  # the broken build: claims that never counted the key's window
    for job_id in ids:
        assert services.claim(A, job_id) is not None
    _throttle({"limit": 2, "period": 60})
    found = run(checks.key_rate_held)
    assert [v.check for v in found] == ["key_rate_held"]
    assert "3 starts" in found[0].detail and "acct" in found[0].detail
