"""Retention of jobs.flow's per-key rows (jobs.flow.retention, D361): what no live job
needs goes, what a waiting job, a halted key or a window still counts stays, and a
submission racing the prune still gathers into one job."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction

from jobs import services, submission
from jobs.flow import debounce, keyrate, retention
from jobs.models import Debounce, Job, KeyHit, Sequence
from jobs.reaper import Reaper

pytestmark = pytest.mark.django_db(transaction=True)


def _run(job_id: int, *, error: str | None = None) -> None:
    lease = services.claim("w-ret", job_id)
    assert lease is not None
    if error is None:
        services.complete([(lease, None)])
    else:
        services.fail([(lease, error, True)])


def _age(model, seconds: float) -> None:
    """Move a row's last use back in time, as if `seconds` had passed."""
    col = "first_at" if model is Debounce else "updated_at"
    with connection.cursor() as cur:
        cur.execute(
            f"UPDATE {model._meta.db_table} SET {col} = {col} - make_interval(secs => %s)",
            [seconds],
        )


def test_debounce_rows_go_once_their_job_ended_and_only_after_the_grace():
    ended = submission.submit("echo", {}, debounce_key="a", debounce_seconds=0.01)[0]
    waiting = submission.submit("echo", {}, debounce_key="b", debounce_seconds=300)[0]
    Job.objects.filter(pk=ended.pk).update(run_at=ended.created_at)
    _run(ended.pk)
    assert retention.prune().debounce == 0  # within the grace: kept
    _age(Debounce, 2 * retention.GRACE)
    assert retention.prune().debounce == 1
    assert list(Debounce.objects.values_list("key", flat=True)) == ["b"]  # its job waits
    # The key's next submission makes a row again, and a job; the waiting key still joins.
    again, created = submission.submit("echo", {}, debounce_key="a", debounce_seconds=300)
    assert created and Debounce.objects.get(key="a").job_id == again.pk
    joined, created = submission.submit("echo", {"v": 2}, debounce_key="b", debounce_seconds=300)
    assert (joined.pk, created) == (waiting.pk, False)


def test_sequence_rows_go_when_idle_and_stay_while_halted_or_waiting():
    idle = submission.submit("echo", {}, sequence_key="idle")[0]
    _run(idle.pk)
    halted = submission.submit("echo", {}, sequence_key="halted")[0]
    submission.submit("echo", {}, sequence_key="halted")
    _run(halted.pk, error="boom")
    busy = submission.submit("echo", {}, sequence_key="busy")[0]
    _age(Sequence, 2 * retention.GRACE)
    assert retention.prune().sequence == 1
    assert set(Sequence.objects.values_list("key", flat=True)) == {"halted", "busy"}
    # An idle key starts afresh: its next job is due at once.
    nxt = submission.submit("echo", {}, sequence_key="idle")[0]
    assert Job.objects.get(pk=nxt.pk).wait_reason is None
    assert Sequence.objects.get(key="idle").active_job_id == nxt.pk
    # The busy key's second job still waits for the first.
    second = submission.submit("echo", {}, sequence_key="busy")[0]
    assert Job.objects.get(pk=second.pk).wait_reason == "sequence"
    _run(busy.pk)
    assert Job.objects.get(pk=second.pk).wait_reason is None


def test_rate_rows_older_than_any_window_go_and_the_others_stay():
    for _ in range(3):
        submission.submit("echo", {}, concurrency_key="crm", rate_limit={"limit": 5, "period": 60})
    KeyHit.objects.filter(pk=KeyHit.objects.order_by("pk")[0].pk).update(
        at=KeyHit.objects.order_by("pk")[0].at - timedelta(days=1, seconds=1)
    )
    assert retention.prune().keyhit == 1
    assert KeyHit.objects.filter(scope=keyrate.SUBMIT).count() == 2


def test_the_reaper_prunes_in_its_sweep():
    job = submission.submit("echo", {}, debounce_key="a", debounce_seconds=0.01)[0]
    Job.objects.filter(pk=job.pk).update(run_at=job.created_at)
    _run(job.pk)
    _age(Debounce, 2 * retention.GRACE)
    report = Reaper(interval=0.1, crash_detection=False).sweep()
    assert report.flow_pruned == 1 and not Debounce.objects.exists()


def test_a_submission_between_making_sure_of_the_row_and_locking_it_finds_it_again():
    """The prune deletes the key's row after a submission's INSERT ... ON CONFLICT found
    it and before its SELECT ... FOR UPDATE: the submission makes the row again and
    answers one job (no lost row, no 500)."""
    job = submission.submit("echo", {}, debounce_key="a", debounce_seconds=0.01)[0]
    Job.objects.filter(pk=job.pk).update(run_at=job.created_at)
    _run(job.pk)
    _age(Debounce, 2 * retention.GRACE)
    real = debounce._LOCK_SQL
    pruned = threading.Event()

    def prune_in_another_connection() -> None:
        try:
            assert retention.prune().debounce == 1
            pruned.set()
        finally:
            connections.close_all()

    calls = []

    def hooked(execute, sql, params, many, context):
        if sql == real and not calls:
            calls.append(1)
            t = threading.Thread(target=prune_in_another_connection)
            t.start()
            t.join()
        return execute(sql, params, many, context)

    with transaction.atomic(), connection.execute_wrapper(hooked):
        new, created = submission.submit("echo", {"v": 2}, debounce_key="a", debounce_seconds=300)
    assert pruned.is_set() and created
    assert Debounce.objects.get(key="a").job_id == new.pk
