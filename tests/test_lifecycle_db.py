"""The lifecycle is enforced by PostgreSQL itself: raw SQL cannot break it."""

from __future__ import annotations

import itertools

import pytest
from django.db import IntegrityError, connection, transaction

from jobs.lifecycle import TRANSITIONS, Status, drop_trigger_sql, guard_trigger_sql, is_legal
from tests.factories import JobFactory, raw

# Column values that satisfy every per-state check constraint, so that only
# the transition guard can object.
VALID_COLUMNS = {
    Status.QUEUED: "owned_by = NULL, claimed_at = NULL, heartbeat_at = NULL, finished_at = NULL",
    Status.ENQUEUE_FAILED: "owned_by = NULL, claimed_at = NULL, heartbeat_at = NULL, "
    "finished_at = NULL",
    Status.PROCESSING: "owned_by = 'w-x', claimed_at = now(), heartbeat_at = now(), "
    "finished_at = NULL",
    Status.DONE: "owned_by = NULL, claimed_at = NULL, heartbeat_at = NULL, finished_at = now(), "
    "error = NULL",
    Status.FAILED: "owned_by = NULL, claimed_at = NULL, heartbeat_at = NULL, "
    "finished_at = now(), error = 'x'",
}


def violated(sql: str, params=None) -> str:
    """Run sql expecting the database to refuse; return the constraint it names."""
    with pytest.raises(IntegrityError) as exc:
        with transaction.atomic():
            raw(sql, params)
    return exc.value.__cause__.diag.constraint_name


ILLEGAL = [
    (a, b) for a, b in itertools.product(Status, Status) if a != b and (a, b) not in TRANSITIONS
]


@pytest.mark.django_db
@pytest.mark.parametrize("old,new", ILLEGAL, ids=[f"{a}->{b}" for a, b in ILLEGAL])
def test_illegal_transition_rejected_by_database(old, new):
    job = JobFactory.create(status=old)
    name = violated(
        f"UPDATE jobs_job SET status = %s, lease_version = lease_version + 1, "
        f"{VALID_COLUMNS[new]} WHERE id = %s",
        [new.value, job.pk],
    )
    assert name == "jobs_job_legal_transition"
    assert raw("SELECT status FROM jobs_job WHERE id = %s", [job.pk])[0][0] == old


@pytest.mark.django_db
@pytest.mark.parametrize(
    "old,new", sorted(TRANSITIONS), ids=[f"{a}->{b}" for a, b in sorted(TRANSITIONS)]
)
def test_every_legal_transition_is_accepted_by_database(old, new):
    job = JobFactory.create(status=old)
    raw(
        f"UPDATE jobs_job SET status = %s, lease_version = lease_version + 1, "
        f"{VALID_COLUMNS[new]} WHERE id = %s",
        [new.value, job.pk],
    )
    assert raw("SELECT status FROM jobs_job WHERE id = %s", [job.pk])[0][0] == new


def test_transition_table_is_closed_and_consistent():
    assert all(is_legal(s, s) for s in Status)
    assert not is_legal(Status.DONE, Status.QUEUED)
    assert (Status.FAILED, Status.QUEUED) in TRANSITIONS
    assert not any(a in (Status.DONE,) for a, _ in TRANSITIONS)


@pytest.mark.django_db
def test_lease_version_may_never_decrease():
    job = JobFactory.create(status="processing")
    name = violated("UPDATE jobs_job SET lease_version = lease_version - 1 WHERE id = %s", [job.pk])
    assert name == "jobs_job_lease_monotonic"


@pytest.mark.django_db
def test_lease_version_may_not_decrease_even_in_terminal_state():
    job = JobFactory.create(status="done")
    assert violated("UPDATE jobs_job SET lease_version = 0 WHERE id = %s", [job.pk]) == (
        "jobs_job_lease_monotonic"
    )


@pytest.mark.django_db
def test_claim_without_lease_bump_rejected():
    job = JobFactory.create()
    name = violated(
        f"UPDATE jobs_job SET status = 'processing', {VALID_COLUMNS[Status.PROCESSING]} "
        "WHERE id = %s",
        [job.pk],
    )
    assert name == "jobs_job_lease_bump"


@pytest.mark.django_db
def test_requeue_without_lease_bump_rejected():
    job = JobFactory.create(status="processing")
    name = violated(
        f"UPDATE jobs_job SET status = 'queued', {VALID_COLUMNS[Status.QUEUED]} WHERE id = %s",
        [job.pk],
    )
    assert name == "jobs_job_lease_bump"


@pytest.mark.django_db
def test_owner_change_without_lease_bump_rejected():
    job = JobFactory.create(status="processing")
    name = violated("UPDATE jobs_job SET owned_by = 'thief' WHERE id = %s", [job.pk])
    assert name == "jobs_job_lease_bump"


@pytest.mark.django_db
def test_heartbeat_keeps_status_and_is_allowed():
    job = JobFactory.create(status="processing")
    raw("UPDATE jobs_job SET heartbeat_at = now() WHERE id = %s", [job.pk])


@pytest.mark.django_db
@pytest.mark.parametrize("status", ["processing", "done", "failed", "enqueue_failed"])
def test_insert_must_start_queued(status):
    name = violated(
        "INSERT INTO jobs_job (task, payload, queue, priority, status, max_retries, retry_count, "
        "lease_version, owned_by, claimed_at, heartbeat_at, finished_at, error) "
        "VALUES ('echo', '{}', 'default', 0, %s, 3, 0, 0, NULL, NULL, NULL, NULL, NULL)",
        [status],
    )
    assert name in ("jobs_job_legal_insert",)


@pytest.mark.django_db
def test_insert_with_nonzero_lease_rejected():
    name = violated(
        "INSERT INTO jobs_job (task, payload, queue, priority, status, max_retries, retry_count, "
        "lease_version) VALUES ('echo', '{}', 'default', 0, 'queued', 3, 0, 5)"
    )
    assert name == "jobs_job_legal_insert"


@pytest.mark.django_db
@pytest.mark.parametrize("status", ["queued", "processing", "enqueue_failed"])
def test_delete_of_unfinished_job_rejected(status):
    job = JobFactory.create(status=status)
    assert violated("DELETE FROM jobs_job WHERE id = %s", [job.pk]) == (
        "jobs_job_delete_terminal_only"
    )


@pytest.mark.django_db
def test_delete_of_finished_job_allowed():
    job = JobFactory.create(status="done")
    raw("DELETE FROM jobs_job WHERE id = %s", [job.pk])


# --- per-state invariants: each named check constraint, violated by raw SQL ---------

INVARIANTS = [
    ("processing", "owned_by = NULL", "job_processing_is_owned"),
    ("processing", "claimed_at = NULL", "job_processing_is_owned"),
    ("processing", "heartbeat_at = NULL", "job_processing_is_owned"),
    ("queued", "owned_by = 'w'", "job_idle_is_unowned"),
    ("queued", "claimed_at = now()", "job_idle_is_unowned"),
    ("enqueue_failed", "owned_by = 'w'", "job_idle_is_unowned"),
    ("done", "owned_by = 'w'", "job_idle_is_unowned"),
    ("failed", "claimed_at = now()", "job_idle_is_unowned"),
    ("done", "error = 'oops'", "job_done_has_no_error"),
    ("failed", "error = NULL", "job_failed_has_error"),
    ("done", "finished_at = NULL", "job_terminal_is_finished"),
    ("queued", "finished_at = now()", "job_terminal_is_finished"),
    ("queued", "retry_count = -1", "job_retry_count_nonneg"),
    ("queued", "max_retries = -1", "job_max_retries_nonneg"),
    ("queued", "priority = 101", "job_priority_range"),
    ("queued", "priority = -101", "job_priority_range"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "status,assignment,constraint", INVARIANTS, ids=[f"{s}:{a}" for s, a, _ in INVARIANTS]
)
def test_per_state_invariant_enforced(status, assignment, constraint):
    job = JobFactory.create(status=status)
    assert violated(f"UPDATE jobs_job SET {assignment} WHERE id = %s", [job.pk]) == constraint


@pytest.mark.django_db
def test_negative_lease_version_rejected_on_insert():
    # The guard fires first on insert; the check constraint backs it up.
    name = violated(
        "INSERT INTO jobs_job (task, payload, queue, priority, status, max_retries, retry_count, "
        "lease_version) VALUES ('echo', '{}', 'default', 0, 'queued', 3, 0, -1)"
    )
    assert name in ("jobs_job_legal_insert", "job_lease_version_nonneg")


@pytest.mark.django_db
def test_check_constraints_stand_without_the_trigger():
    """With the trigger dropped (inside this test's transaction, rolled back after),
    the named check constraints alone still refuse what the guard would catch first."""
    job = JobFactory.create()
    raw(drop_trigger_sql("jobs_job"))
    try:
        name = violated(
            "INSERT INTO jobs_job (task, payload, queue, priority, status, max_retries, "
            "retry_count, lease_version) VALUES ('echo', '{}', 'default', 0, 'queued', 3, 0, -1)"
        )
        assert name == "job_lease_version_nonneg"
        name = violated("UPDATE jobs_job SET status = 'lost' WHERE id = %s", [job.pk])
        assert name == "job_status_valid"
    finally:
        raw(guard_trigger_sql("jobs_job", "jobs_jobevent"))


@pytest.mark.django_db
def test_installed_guard_matches_lifecycle():
    """The trigger in the database is the one lifecycle.py generates today; a change
    to the rules without a migration that reinstalls it fails here."""
    with connection.cursor() as cur:
        cur.execute("SELECT prosrc FROM pg_proc WHERE proname = 'jobs_job_guard'")
        installed = cur.fetchone()[0]
    expected = guard_trigger_sql("jobs_job", "jobs_jobevent")
    body = expected.split("AS $$", 1)[1].split("$$;", 1)[0]
    assert installed.strip() == body.strip()
