"""The partitioned layout (issue 33): every partition carries the guarantees, the mover
moves finished jobs without touching their history or lease, and the writes that can
meet the mover (idempotent submissions, staff retries, retention) stay correct."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, connections, transaction

from jobs import lifecycle, metrics, partitions, selectors, services
from jobs.models import Job, JobEvent
from jobs.pgtypes import HOT
from jobs.services.claims import plain
from tests.factories import JobFactory, raw

pytestmark = pytest.mark.django_db


def _children(parent: str) -> list[str]:
    return [
        r[0]
        for r in raw(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = %s::regclass ORDER BY 1",
            [parent],
        )
    ]


def _names(sql: str, table: str) -> set[str]:
    return {r[0] for r in raw(sql, [table])}


def _named_checks(table: str) -> set[str]:
    return _names(
        "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'c'",
        table,
    )


def _row_triggers(table: str) -> set[str]:
    # tgtype bit 0: FOR EACH ROW
    return _names(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = %s::regclass AND tgtype & 1 = 1"
        " AND NOT tgisinternal",
        table,
    )


def _finished(status: str = "done", **kw) -> Job:
    return JobFactory.create(status=status, **kw)


def _move_all() -> int:
    moved = 0
    while n := partitions.move_batch(hot_seconds=0):
        moved += n
    return moved


def test_every_partition_has_every_named_check_and_row_trigger():
    _finished()
    _move_all()  # creates the current period's cold partition of jobs_job
    partitions.ensure_ahead()
    jobs = _children("jobs_job")
    assert "jobs_job_hot" in jobs and any(p.startswith("jobs_job_p") for p in jobs), jobs
    checks, triggers = _named_checks("jobs_job"), _row_triggers("jobs_job")
    assert {"job_cold_is_finished", "job_status_valid", "job_terminal_is_finished"} <= checks
    assert triggers == {
        "jobs_job_guard",
        "jobs_job_wait_clear",
        "jobs_job_sequence_enter",  # a sequence's order (jobs.flow.triggers, D345)
        "jobs_job_sequence_revive",
    }
    for part in jobs:
        assert _named_checks(part) >= checks, part
        assert _row_triggers(part) == triggers, part
    # Statement triggers (history, workflows) are the parent's: they see every partition.
    statement = raw(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = 'jobs_job'::regclass AND tgtype & 1 = 0"
    )
    assert {r[0] for r in statement} == {
        "jobs_job_history_insert",
        "jobs_job_history_update",
        "jobs_job_dependents",
        "jobs_job_flow",  # sequences and batches see every partition's ends (D345, D347)
    }
    events = _children("jobs_jobevent")
    assert "jobs_jobevent_legacy" in events and len(events) >= 4, events
    # Each partition has its own primary key on id (ids come from one sequence).
    for part in jobs + events:
        assert raw(
            "SELECT 1 FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'p'", [part]
        ), part


def test_the_mover_moves_finished_jobs_only_and_writes_no_history():
    done, failed = _finished("done"), _finished("failed")
    live = [JobFactory.create(), JobFactory.create(status="processing")]
    before = {j.pk: (j.lease_version, j.updated_at, j.event_seq) for j in (done, failed)}
    events_before = JobEvent.objects.count()
    moved_metric = metrics.PARTITION_MOVED._value.get()

    assert _move_all() == 2

    assert JobEvent.objects.count() == events_before
    assert metrics.PARTITION_MOVED._value.get() - moved_metric == 2
    for job in (done, failed):
        job.refresh_from_db()
        assert job.period == partitions.period_start(job.created_at) != HOT
        assert (job.lease_version, job.updated_at, job.event_seq) == before[job.pk]
        (part,) = raw("SELECT tableoid::regclass::text FROM jobs_job WHERE id = %s", [job.pk])[0]
        assert part == partitions.partition_name("jobs_job", job.period)
    for job in live:
        job.refresh_from_db()
        assert job.period == HOT
    # The hot window: a job finished just now stays hot.
    recent = _finished()
    assert partitions.move_batch(hot_seconds=3600) == 0
    recent.refresh_from_db()
    assert recent.period == HOT


def test_a_cold_job_reads_back_through_the_selectors_with_its_history():
    job = _finished("done")
    _move_all()
    assert Job.objects.get(pk=job.pk).status == "done"
    assert selectors.table_estimate() >= 0 or selectors.table_estimate() == -1
    seqs = list(JobEvent.objects.filter(job_id=job.pk).values_list("seq", flat=True))
    assert seqs == [1, 2, 3]


def test_staff_retry_brings_a_cold_failed_job_back_hot_and_history_goes_on():
    job = _finished("failed")
    _move_all()
    job.refresh_from_db()
    assert job.period != HOT
    assert services.staff_retry([job.pk], "staff:alice") == [job.pk]
    job.refresh_from_db()
    assert (job.status, job.period) == ("queued", HOT)
    events = list(JobEvent.objects.filter(job_id=job.pk).order_by("id"))
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert (events[-1].from_status, events[-1].to_status) == ("failed", "queued")
    assert events[-1].job_created_at == job.created_at
    # It runs again like any job.
    lease = services.claim("w-1", job.pk)
    assert lease is not None and services.complete([(lease, 1)])


def test_a_live_job_cannot_be_made_cold():
    """The guard refuses the move's delete half; job_cold_is_finished would refuse
    the row in any cold partition after it."""
    job = JobFactory.create()
    with pytest.raises(Exception, match="illegal job delete"), transaction.atomic():
        raw(
            "UPDATE jobs_job SET period = %s WHERE id = %s",
            [partitions.period_start(job.created_at), job.pk],
        )


def test_an_insert_into_a_cold_partition_is_refused_by_the_guard():
    job = _finished()
    _move_all()
    job.refresh_from_db()
    with pytest.raises(Exception, match="illegal job insert"), transaction.atomic():
        raw(
            "INSERT INTO jobs_job (task, payload, queue, priority, max_retries, retry_count, "
            "lease_version, status, finished_at, period) VALUES ('x', '{}', 'default', 0, 0, "
            "0, 0, 'done', now(), %s)",
            [job.period],
        )


def test_an_idempotency_key_held_by_a_cold_job_returns_that_job():
    job, created = services.submit("echo", {}, idempotency_key="k-cold", request_hash="h")
    lease = services.claim("w-1", job.pk)
    services.complete([(lease, 1)])
    _move_all()
    again, created = services.submit("echo", {}, idempotency_key="k-cold", request_hash="h")
    assert (again.pk, created) == (job.pk, False)
    assert Job.objects.filter(idempotency_key="k-cold").count() == 1
    [item] = services.submit_many(
        [services.NewJob("echo", {}, idempotency_key="k-cold", request_hash="h")]
    )
    assert (item.job_id, item.created) == (job.pk, False)
    assert Job.objects.filter(idempotency_key="k-cold").count() == 1


def test_a_unique_key_is_free_again_once_its_holder_finished_and_moved():
    first, _ = services.submit("echo", {}, unique_key="u1")
    lease = services.claim("w-1", first.pk)
    services.complete([(lease, 1)])
    _move_all()
    second, created = services.submit("echo", {}, unique_key="u1")
    assert created and second.pk != first.pk
    dup, created = services.submit("echo", {}, unique_key="u1")
    assert not created and dup.pk == second.pk


def test_the_claim_plan_reads_only_the_hot_partition():
    _finished()
    _move_all()
    JobFactory.create()
    with connection.cursor() as cur:
        params = {"queue": "default", "limit": 5, "worker": "w", "actor": "a", "start": 1}
        cur.execute("EXPLAIN " + plain._CLAIM_NEXT_SQL, params)
        plan = "\n".join(r[0] for r in cur.fetchall())
    assert "jobs_job_hot" in plan
    assert "jobs_job_p" not in plan, plan


def _hold_move(job_id: int, moving: threading.Event, release: threading.Event) -> None:
    """The mover's statement for one job, left uncommitted until `release`."""
    try:
        with transaction.atomic():
            with connection.cursor() as cur:
                cur.execute(
                    "UPDATE jobs_job SET period = date_trunc(%s, created_at AT TIME ZONE 'UTC')"
                    "::date WHERE id = %s AND period = 'infinity'",
                    [partitions.unit(), job_id],
                )
                assert cur.rowcount == 1
            moving.set()
            assert release.wait(30)
    finally:
        connections.close_all()


def _blocked_on_lock(application_pid: int | None = None) -> bool:
    return bool(
        raw(
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        )
    )


def _wait_until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.django_db(transaction=True)
def test_submissions_racing_the_mover_of_the_key_holder_make_no_second_job():
    """Concurrent submissions of a key while the mover moves its holder from hot to
    cold: each waits on the mover's uncommitted delete from hot, then finds the cold
    row in its next statement and returns it (D159)."""
    partitions.ensure_ahead()
    holder, _ = services.submit("echo", {}, idempotency_key="k-race", request_hash="h")
    lease = services.claim("w-1", holder.pk)
    services.complete([(lease, 1)])
    partitions.ensure({partitions.JOBS: {partitions.period_start(holder.created_at)}})
    moving, release = threading.Event(), threading.Event()
    mover = threading.Thread(target=_hold_move, args=(holder.pk, moving, release))
    mover.start()
    assert moving.wait(10)
    results: list = [None] * 3

    def submit(i: int) -> None:
        try:
            if i == 2:
                (item,) = services.submit_many(
                    [services.NewJob("echo", {}, idempotency_key="k-race", request_hash="h")]
                )
                results[i] = (item.job_id, item.created)
            else:
                job, created = services.submit(
                    "echo", {}, idempotency_key="k-race", request_hash="h"
                )
                results[i] = (job.pk, created)
        except BaseException as exc:
            results[i] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    _wait_until(lambda: len(raw(
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock'")) >= 3)  # fmt: skip
    release.set()
    mover.join(30)
    for t in threads:
        t.join(30)
    assert results == [(holder.pk, False)] * 3
    assert Job.objects.filter(idempotency_key="k-race").count() == 1
    holder.refresh_from_db()
    assert holder.period != HOT


def _under_an_uncommitted_move(job: Job, write, wait) -> list:
    """Run `write()` in a thread while the mover's move of `job` is uncommitted; commit
    the move once `wait()` says the write got where it should; the write's result."""
    partitions.ensure({partitions.JOBS: {partitions.period_start(job.created_at)}})
    moving, release = threading.Event(), threading.Event()
    mover = threading.Thread(target=_hold_move, args=(job.pk, moving, release))
    mover.start()
    assert moving.wait(10)
    out: list = []

    def run() -> None:
        try:
            out.append(write())
        except BaseException as exc:
            out.append(exc)
        finally:
            connections.close_all()

    t = threading.Thread(target=run)
    t.start()
    wait()
    release.set()
    mover.join(30)
    t.join(30)
    return out


@pytest.mark.django_db(transaction=True)
def test_a_staff_retry_racing_the_mover_is_tried_again_not_an_error(caplog):
    """The retry's UPDATE waits on the mover's lock; the mover commits, the row is
    in a cold partition: PostgreSQL answers 40001, the retry runs again (D162)."""
    job = _finished("failed")
    out = _under_an_uncommitted_move(
        job,
        lambda: services.staff_retry([job.pk], "staff:bob"),
        lambda: _wait_until(_blocked_on_lock),
    )
    assert out == [[job.pk]]
    assert "moved partition under a write" in caplog.text  # the 40001 was met, and retried
    job.refresh_from_db()
    assert (job.status, job.period) == ("queued", HOT)


@pytest.mark.django_db(transaction=True)
def test_a_prune_racing_the_mover_is_tried_again_not_an_error():
    job = _finished("done")
    raw("UPDATE jobs_job SET finished_at = now() - interval '2 days' WHERE id = %s", [job.pk])
    out = _under_an_uncommitted_move(
        job,
        lambda: services.prune_finished(86400, ["done"], 100),
        # the prune's snapshot sees the row hot; SKIP LOCKED passes it by
        lambda: time.sleep(0.3),
    )
    assert len(out) == 1 and not isinstance(out[0], BaseException), out
    # The prune took the row while hot, or the mover moved it first: then it is cold,
    # and goes with its period (jobs.archive), never row by row.
    services.prune_finished(86400, ["done"], 100)
    left = list(Job.objects.filter(pk=job.pk).values_list("period", flat=True))
    assert left in ([], [partitions.period_start(job.created_at)])
    assert JobEvent.objects.filter(job_id=job.pk).exists() == bool(left)


def test_history_partitions_follow_the_job_created_at():
    bound = partitions.legacy_bound(connection.cursor())
    assert bound is not None and bound > datetime.now(UTC).date()
    job = JobFactory.create(status="done")
    events = list(JobEvent.objects.filter(job_id=job.pk))
    assert {e.job_created_at for e in events} == {job.created_at}
    # Jobs created before the first period start keep their history in legacy.
    parts = raw("SELECT DISTINCT tableoid::regclass::text FROM jobs_jobevent WHERE job_id = %s",
                [job.pk])  # fmt: skip
    assert parts == [("jobs_jobevent_legacy",)]
    # A job created in a partitioned period writes its history there.
    later = datetime.combine(bound, datetime.min.time(), UTC) + timedelta(hours=1)
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO jobs_job (task, payload, queue, priority, max_retries, retry_count, "
            "lease_version, status, created_at) VALUES ('x', '{}', 'default', 0, 0, 0, 0, "
            "'queued', %s) RETURNING id",
            [later],
        )
        new_id = cur.fetchone()[0]
    parts = raw("SELECT tableoid::regclass::text FROM jobs_jobevent WHERE job_id = %s", [new_id])
    assert parts == [(partitions.partition_name("jobs_jobevent", bound),)]


def test_lifecycle_moves_of_live_jobs_name_the_hot_partition():
    assert lifecycle.CLAIM.where() == "status = 'queued' AND period = 'infinity'"
    assert lifecycle.EXPIRE.where("j.status") == "j.status = 'processing' AND j.period = 'infinity'"
    assert "period" not in lifecycle.STAFF_RETRY.where()


def test_jobs_of_a_detached_or_archived_period_wait_hot_and_the_rest_still_move():
    now = datetime.now(UTC)
    detached, archived = now - timedelta(days=21), now - timedelta(days=35)
    kept = [_finished(), _finished()]
    for job, at in zip(kept, (detached, archived), strict=True):
        raw("UPDATE jobs_job SET created_at = %s WHERE id = %s", [at, job.pk])
        job.refresh_from_db()
    free = _finished()
    # A period a crashed prune left detached, and one archived and not restored.
    start = partitions.period_start(detached)
    raw(f"CREATE TABLE {partitions.partition_name('jobs_job', start)} (LIKE jobs_job)")
    gone = partitions.period_start(archived)
    raw(
        "INSERT INTO jobs_archivedperiod (period, starts_at, ends_at, jobs, events, location,"
        " files, bytes, archived_at) VALUES (%s, %s, %s, 0, 0, '/nowhere', '{}', 0, now())",
        [gone, gone, partitions.next_start(gone)],
    )

    # The stuck jobs finished first: they must not hold back the batch behind them.
    assert partitions.move_batch(hot_seconds=0, batch=1) == 1

    free.refresh_from_db()
    assert free.period == partitions.period_start(free.created_at)
    for job in kept:
        job.refresh_from_db()
        assert job.period == HOT
    assert partitions.move_batch(hot_seconds=0) == 0


def test_the_reaper_exports_the_hot_rows_the_movers_lag_and_the_runway(settings):
    """What an operator watches: a finished job the mover has not moved past the hot
    window shows as lag until it moves; the runway covers the periods made ahead."""
    from jobs.collectors import PartitionCollector

    def gauges() -> dict[str, float]:
        return {f.name: f.samples[0].value for f in PartitionCollector(cache_seconds=0).collect()}

    settings.JOBS_HOT_FINISHED_SECONDS = 3600
    _move_all()
    assert gauges()["jobs_partition_move_lag_seconds"] == 0
    late, recent = _finished(), _finished("failed")
    raw("UPDATE jobs_job SET finished_at = now() - interval '2 hours' WHERE id = %s", [late.pk])
    raw("ANALYZE jobs_job_hot")
    (hot,) = raw("SELECT count(*) FROM jobs_job_hot")[0]

    got = gauges()

    assert 3600 - 5 < got["jobs_partition_move_lag_seconds"] < 3600 + 60
    assert got["jobs_hot_partition_rows"] == hot
    partitions.ensure_ahead()
    runway = gauges()["jobs_partition_runway_seconds"]
    assert settings.JOBS_PARTITION_AHEAD * 7 * 86400 <= runway < 366 * 86400
    assert partitions.move_batch(hot_seconds=3600) == 1  # the late one, not the recent one
    assert gauges()["jobs_partition_move_lag_seconds"] == 0
    recent.refresh_from_db()
    assert recent.period == HOT


@pytest.mark.django_db(transaction=True)
def test_a_sweep_facing_a_detach_left_pending_never_fails_and_attaches_it_once_it_can(settings):
    """The current period's partition is detach pending (an interrupted DETACH …
    CONCURRENTLY) and an old snapshot keeps FINALIZE waiting: the sweep neither fails nor
    waits past the lock timeout, the jobs of other periods still move, the gauge says so.
    A prunejobs archiving now is left to finish its own detach. Once both are gone the
    next sweep attaches the partition again and its jobs move (D214)."""
    import psycopg

    from jobs.archive import tables
    from jobs.collectors import PartitionCollector
    from jobs.reaper import Reaper
    from tests.harness import database_url, interrupt_detach

    def pending() -> float:
        (family,) = [
            f
            for f in PartitionCollector(cache_seconds=0).collect()
            if f.name == "jobs_partition_detach_pending"
        ]
        return family.samples[0].value

    settings.JOBS_HOT_FINISHED_SECONDS = 0
    settings.JOBS_PARTITION_LOCK_TIMEOUT = 0.2
    partitions.ensure_ahead()
    start = partitions.period_start(datetime.now(UTC))
    table = partitions.partition_name("jobs_job", start)
    older, current = _finished(), _finished("failed")
    raw("UPDATE jobs_job SET created_at = now() - interval '40 days' WHERE id = %s", [older.pk])
    url = database_url()
    interrupt_detach(url, "jobs_job", table)
    reaper = Reaper(interval=0.1)
    try:
        assert pending() == 1
        with psycopg.connect(url) as holder:
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT 1")
            began = time.monotonic()
            report = reaper.sweep()
            assert time.monotonic() - began < 5
        assert report.moved == 1
        older.refresh_from_db()
        current.refresh_from_db()
        assert (older.period, current.period) == (partitions.period_start(older.created_at), HOT)
        assert pending() == 1
        with psycopg.connect(url, autocommit=True) as prune:
            prune.execute("SELECT pg_advisory_lock(%s)", [tables._LOCK_KEY])
            assert partitions.attach_pending_detaches() == 0
            # Given back before the close: a closed session's locks go only when its backend ends.
            prune.execute("SELECT pg_advisory_unlock_all()")

        report = reaper.sweep()

        assert report.moved == 1
        assert pending() == 0
        assert raw("SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = %s::regclass",
                   [table]) == [(False,)]  # fmt: skip
        assert raw("SELECT tableoid::regclass::text FROM jobs_job WHERE id = %s", [current.pk]) == [
            (table,)
        ]
    finally:
        for parent, name, bound in partitions.detach_pending():
            raw(f"ALTER TABLE {parent} DETACH PARTITION {name} FINALIZE")
            raw(f"ALTER TABLE {parent} ATTACH PARTITION {name} {bound}")
