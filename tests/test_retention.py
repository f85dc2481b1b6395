"""Retention: `prunejobs` deletes only old terminal jobs, with their history, in
bounded batches, and never gets in the way of workers."""

from __future__ import annotations

import re
import threading
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction

from jobs import services
from jobs.management.commands.prunejobs import parse_duration, parse_statuses
from tests.factories import JobFactory, raw

DAY = 86400


def age(job_ids: list[int], days: float) -> None:
    """Move finished_at/created_at back in time. Same-status updates are not
    transitions, so the lifecycle guard allows them."""
    raw(
        """UPDATE jobs_job SET created_at = now() - %s * interval '1 day' - interval '1 minute',
                  finished_at = CASE WHEN finished_at IS NULL THEN NULL
                                     ELSE now() - %s * interval '1 day' END
           WHERE id = ANY(%s)""",
        [days, days, job_ids],
    )


def existing(job_ids: list[int]) -> set[int]:
    return {r[0] for r in raw("SELECT id FROM jobs_job WHERE id = ANY(%s)", [job_ids])}


def events_of(job_ids: list[int]) -> int:
    return raw("SELECT count(*) FROM jobs_jobevent WHERE job_id = ANY(%s)", [job_ids])[0][0]


def make(status: str, n: int, days: float | None = None, queue: str = "default") -> list[int]:
    ids = [JobFactory.create(status=status, queue=queue).pk for _ in range(n)]
    if days is not None:
        age(ids, days)
    return ids


def prune(*args: str) -> str:
    out = StringIO()
    call_command("prunejobs", *args, stdout=out)
    return out.getvalue()


# --- input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,seconds",
    [("7d", 7 * DAY), ("12h", 43200), ("30m", 1800), ("45s", 45), ("2w", 14 * DAY), ("1D", DAY)],
)
def test_duration_parser(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7", "d", "7x", "-1d", "1.5d", "0d", "7 days", "7d12h"])
def test_duration_parser_rejects_bad_input(text):
    with pytest.raises(CommandError, match="--older-than"):
        parse_duration(text)


def test_status_parser():
    assert parse_statuses("failed, done,done") == ["done", "failed"]
    for bad, why in [
        ("queued", "not terminal"),
        ("processing", "not terminal"),
        ("done,enqueue_failed", "not terminal"),
        ("bogus", "not a job status"),
        ("", "at least one"),
    ]:
        with pytest.raises(CommandError, match=why):
            parse_statuses(bad)


@pytest.mark.django_db
@pytest.mark.parametrize(
    "args,message",
    [
        (["--older-than", "7x"], "not a duration"),
        (["--older-than", "7d", "--status", "queued"], "not terminal"),
        (["--older-than", "7d", "--batch", "0"], "--batch"),
        (["--older-than", "7d", "--batch", "1000001"], "--batch"),
        (["--older-than", "7d", "--pause", "-1"], "--pause"),
    ],
)
def test_bad_arguments_change_nothing(args, message):
    old = make("done", 2, days=30)
    with pytest.raises(CommandError, match=message):
        prune(*args)
    assert existing(old) == set(old)


def test_service_refuses_non_terminal_statuses(db):
    for statuses in (["queued"], ["done", "processing"], []):
        with pytest.raises(ValueError, match="terminal"):
            services.prune_finished(DAY, statuses, 10)


# --- what goes and what stays ----------------------------------------------------------


@pytest.mark.django_db
def test_prunes_only_old_terminal_jobs_with_their_history():
    old_done = make("done", 4, days=10)
    old_failed = make("failed", 3, days=10)
    recent_done = make("done", 2, days=6)  # inside the 7-day window
    fresh_failed = make("failed", 2)
    # Unfinished jobs created long ago: never touched, whatever their age.
    old_queued = make("queued", 2, days=30)
    old_processing = make("processing", 2, days=30)
    old_parked = make("enqueue_failed", 1, days=30)
    kept = recent_done + fresh_failed + old_queued + old_processing + old_parked
    kept_events = events_of(kept)
    assert events_of(old_done + old_failed) == 7 * 3  # queued, processing, done/failed

    out = prune("--older-than", "7d")

    assert existing(old_done + old_failed) == set()
    assert events_of(old_done + old_failed) == 0
    assert existing(kept) == set(kept)
    assert events_of(kept) == kept_events
    assert "pruned 7 jobs" in out
    statuses = dict(raw("SELECT id, status FROM jobs_job WHERE id = ANY(%s)", [kept]))
    assert [statuses[i] for i in old_processing] == ["processing"] * 2


@pytest.mark.django_db
def test_status_filter_keeps_the_other_terminal_status():
    done = make("done", 3, days=10)
    failed = make("failed", 3, days=10)
    out = prune("--older-than", "1d", "--status", "failed")
    assert existing(failed) == set()
    assert existing(done) == set(done)
    assert "pruned 3 jobs" in out


@pytest.mark.django_db
def test_deletes_in_bounded_batches():
    old = make("done", 25, days=8)
    keep = make("done", 3, days=1)
    out = prune("--older-than", "7d", "--batch", "10")
    batches = [line for line in out.splitlines() if line.startswith("batch ")]
    assert batches == [
        "batch 1: 10 jobs deleted",
        "batch 2: 10 jobs deleted",
        "batch 3: 5 jobs deleted",
    ]
    assert "pruned 25 jobs and their history in 3 batches" in out
    assert existing(old) == set()
    assert existing(keep) == set(keep)


@pytest.mark.django_db
def test_service_deletes_one_batch_per_call():
    make("failed", 7, days=3)
    assert [services.prune_finished(DAY, ["done", "failed"], 3) for _ in range(4)] == [3, 3, 1, 0]


@pytest.mark.django_db
def test_cutoff_uses_the_database_clock():
    """A row finished 59 minutes ago by the database clock survives --older-than 1h;
    one finished 61 minutes ago goes."""
    young, old = make("done", 1), make("done", 1)
    raw("UPDATE jobs_job SET finished_at = now() - interval '59 minutes' WHERE id = %s", young)
    raw("UPDATE jobs_job SET finished_at = now() - interval '61 minutes' WHERE id = %s", old)
    prune("--older-than", "1h")
    assert existing(young + old) == set(young)


@pytest.mark.django_db
def test_dry_run_counts_and_changes_nothing():
    old = make("done", 3, days=9) + make("failed", 2, days=9)
    out = prune("--older-than", "7d", "--dry-run")
    assert "would delete 5 jobs (done: 3, failed: 2) and 15 history rows" in out
    assert existing(old) == set(old)
    assert events_of(old) == 15


# --- beside live workers -----------------------------------------------------------------


def _claim_and_complete_all(
    worker: str,
    queue: str,
    expected: int,
    deadline: float,
    done: list[int] | None = None,
    work: float = 0.0,
) -> list[int]:
    """A worker loop on its own connection until `expected` jobs are finished (by
    all workers sharing `done`); lock_timeout turns any wait into an error."""
    import time

    done = [] if done is None else done
    mine: list[int] = []
    with connection.cursor() as cur:
        cur.execute("SET lock_timeout = '2s'")
    while len(done) < expected and time.monotonic() < deadline:
        leases = services.claim_next(worker, [queue], 5)
        finished = list(services.complete([(lease, {"ok": lease.job_id}) for lease in leases]))
        mine += finished
        done += finished  # list.__iadd__ is atomic under the GIL
        time.sleep(work)  # the handler's time
    return mine


@pytest.mark.django_db(transaction=True)
def test_an_open_prune_batch_never_blocks_workers():
    """While a prune batch holds its row locks (transaction still open), a worker on
    another connection claims and completes other jobs without waiting."""
    import time

    old = make("done", 30, days=10)
    live = make("queued", 12, queue="live")
    pruned_uncommitted = threading.Event()
    workers_done = threading.Event()
    result: dict[str, object] = {}

    def pruner() -> None:
        try:
            with transaction.atomic():
                result["pruned"] = services.prune_finished(7 * DAY, ["done", "failed"], 100)
                pruned_uncommitted.set()
                result["workers_done_in_time"] = workers_done.wait(20)
        finally:
            pruned_uncommitted.set()
            connection.close()

    t = threading.Thread(target=pruner)
    t.start()
    try:
        assert pruned_uncommitted.wait(20)
        started = time.monotonic()
        finished = _claim_and_complete_all("w-live", "live", len(live), started + 20)
        elapsed = time.monotonic() - started
    finally:
        workers_done.set()
        t.join(30)
    assert sorted(finished) == sorted(live)
    assert elapsed < 5, f"worker took {elapsed:.1f}s beside an open prune batch"
    assert result == {"pruned": 30, "workers_done_in_time": True}
    assert existing(old) == set()
    assert {r[0] for r in raw("SELECT status FROM jobs_job WHERE id = ANY(%s)", [live])} == {"done"}


@pytest.mark.django_db(transaction=True)
def test_prune_skips_rows_others_hold_instead_of_waiting():
    """A terminal row locked by another transaction (say a staff retry in flight) is
    skipped, not waited for; the prune finishes and the row survives."""
    old = make("failed", 5, days=10)
    held = old[0]
    locked, release = threading.Event(), threading.Event()

    def holder() -> None:
        try:
            with transaction.atomic():
                raw("SELECT id FROM jobs_job WHERE id = %s FOR UPDATE", [held])
                locked.set()
                release.wait(20)
        finally:
            locked.set()
            connection.close()

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert locked.wait(20)
        raw("SET lock_timeout = '2s'")
        out = prune("--older-than", "7d", "--batch", "2")
    finally:
        release.set()
        t.join(30)
        raw("RESET lock_timeout")
    assert existing(old) == {held}
    assert "pruned 4 jobs" in out
    # The next run takes it.
    prune("--older-than", "7d")
    assert existing(old) == set()


@pytest.mark.django_db(transaction=True)
def test_prune_beside_running_workers_loses_nothing():
    """Workers keep claiming and completing while prunejobs runs in small batches:
    every live job finishes once, every old job goes, no live job is touched."""
    import time

    old = make("done", 120, days=10) + make("failed", 40, days=10)
    live = make("queued", 40, queue="live")
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []
    deadline = time.monotonic() + 30
    done: list[int] = []

    def worker(name: str) -> None:
        try:
            results[name] = _claim_and_complete_all(
                name, "live", len(live), deadline, done, work=0.02
            )
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    outputs = []
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        outputs.append(prune("--older-than", "7d", "--batch", "7"))
    for t in threads:
        t.join(30)
    overlapping = len(outputs)
    outputs.append(prune("--older-than", "7d", "--batch", "7"))

    assert not errors, errors
    finished = results["w0"] + results["w1"]
    assert sorted(finished) == sorted(live), "a live job was lost or completed twice"
    assert existing(old) == set()
    assert events_of(old) == 0
    assert {r[0] for r in raw("SELECT status FROM jobs_job WHERE id = ANY(%s)", [live])} == {"done"}
    # Each live job's history is whole: queued → processing → done.
    assert events_of(live) == 3 * len(live)
    assert overlapping >= 1, "prunejobs never ran while the workers were running"
    counts = [int(re.search(r"pruned (\d+) jobs", out).group(1)) for out in outputs]
    assert sum(counts) == len(old)
