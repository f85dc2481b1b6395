"""Continue-as-new, the replay order check and ctx.patched (issue 45), through the
worker's own execute and write-back paths against the real database; the signal at
the switch raced for real on separate connections."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

import tests.durable_tasks  # noqa: F401 - registers the durable test tasks
from jobs import durable, selectors, services, signals
from jobs.models import Job, JobSignal, JobStep
from jobs.worker import OutcomeKind, Worker
from tests.durable_tasks import VERSION
from tests.harness import wait_until
from tests.test_durable_races import _conn
from tests.test_durable_steps import run_once

pytestmark = pytest.mark.django_db(transaction=True)


def live_run(job_id: int) -> Job:
    """The chain's run that has not continued (the job itself for a plain job)."""
    job = Job.objects.get(pk=job_id)
    while job.next_run_id is not None:
        job = Job.objects.get(pk=job.next_run_id)
    return job


def drive(job_id: int, limit: int = 2000) -> Job:
    """Run the chain's live run attempt by attempt until the chain ends."""
    for _ in range(limit):
        job = live_run(job_id)
        if job.status in ("done", "failed"):
            return job
        run_once(job.pk)
    raise AssertionError("the chain did not end")


def test_a_loop_continues_as_new_with_bounded_runs_and_every_step_once(tmp_path):
    job, _ = services.submit(
        "durable.loop", {"dir": str(tmp_path), "total": 40, "every": 10}, max_retries=0
    )
    last = drive(job.pk)
    assert last.status == "done" and last.result == {"i": 40, "run_started_at": 30}
    runs = list(Job.objects.filter(chain_id=job.pk).order_by("run_number"))
    assert [r.run_number for r in runs] == [1, 2, 3, 4]
    assert runs[0].id == job.pk and runs[0].run_number == 1  # the first run is numbered too
    assert [r.status for r in runs] == ["done"] * 4
    for before, after in zip(runs, runs[1:], strict=False):
        assert before.next_run_id == after.id
        assert before.result == {"continued_as_new": after.id}
        assert after.previous_run_ids[-1] == before.id
    assert runs[-1].previous_run_ids == [r.id for r in runs[:-1]]
    for run in runs:  # each run's history: its own 10 steps and 10 sleeps
        assert JobStep.objects.filter(job_id=run.id).count() == 20
    lines = (tmp_path / "loop-steps").read_text().splitlines()
    assert [line.split()[0] for line in lines] == [str(i) for i in range(40)]  # once each


def test_retention_prunes_finished_runs_with_their_steps(tmp_path):
    job, _ = services.submit("durable.loop", {"dir": str(tmp_path), "total": 6, "every": 2})
    drive(job.pk)
    Job.objects.filter(chain_id=job.pk).update(finished_at="2000-01-01T00:00:00Z")
    assert services.prune_finished(60, ["done", "failed"], 100) == 3
    assert not JobStep.objects.filter(job_id__in=[job.pk]).exists()
    assert not Job.objects.filter(chain_id=job.pk).exists()


def test_the_api_fields_show_the_run_and_the_previous_runs(tmp_path):
    job, _ = services.submit("durable.loop", {"dir": str(tmp_path), "total": 4, "every": 2})
    for _ in range(4):  # two iterations: the first run continues
        run_once(job.pk)
    first = Job.objects.get(pk=job.pk)
    second = Job.objects.get(pk=first.next_run_id)
    assert (second.run_number, second.chain_id, second.previous_run_ids) == (2, job.pk, [job.pk])
    history = selectors.job_history(first.pk)
    assert (history["steps"], history["waits"]) == (2, 2) and history["bytes"] > 0


def test_a_signal_sent_to_an_earlier_run_goes_to_the_live_run():
    job, _ = services.submit("durable.chained_signal", {})
    run_once(job.pk)  # run 1 continues as new
    second = live_run(job.pk)
    assert second.pk != job.pk
    run_once(second.pk)  # run 2 parks on the wait for "go"
    assert signals.signal_job(job.pk, "go", {"n": 1}) is True  # to run 1's id: forwarded
    assert drive(job.pk).result == {"n": 1}
    assert list(JobSignal.objects.values_list("job_id", flat=True)) == [second.pk]


def test_a_signal_kept_by_the_ending_run_moves_to_the_next_run():
    job, _ = services.submit("durable.chained_signal", {})
    lease = services.claim("w-1", job.pk)
    assert signals.signal_job(job.pk, "go", 7) is False  # kept: the job runs
    Worker(worker_id="w-1")._execute(lease, durable.context(lease))  # continues as new
    second = live_run(job.pk)
    assert JobSignal.objects.get().job_id == second.pk
    assert drive(job.pk).result == 7


def _waiting_on_locks() -> int:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()"
        )
        return cur.fetchone()[0]


@pytest.mark.parametrize("first", ["signal", "continue"])
def test_a_signal_at_the_switch_is_delivered_to_exactly_one_run(first):
    """The job's row is held while the signal and the continue-as-new queue for it in
    a forced order; whichever goes first, the signal lands on one run only, and the
    next run consumes it."""
    job, _ = services.submit("durable.chained_signal", {})
    lease = services.claim("w-1", job.pk)
    holder = _conn()
    holder.execute("SELECT 1 FROM jobs_job WHERE id = %s FOR UPDATE", [job.pk])
    errors: list[BaseException] = []

    def in_thread(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # reported below
                errors.append(exc)
            finally:
                connection.close()

        t = threading.Thread(target=run)
        t.start()
        return t

    sending = lambda: signals.signal_job(job.pk, "go", {"at": "switch"})  # noqa: E731
    switching = lambda: services.continue_as_new(lease, '{"run": 2}')  # noqa: E731
    order = [sending, switching] if first == "signal" else [switching, sending]
    threads = []
    try:
        for n, fn in enumerate(order, start=1):
            threads.append(in_thread(fn))
            wait_until(lambda n=n: _waiting_on_locks() >= n, timeout=10)
    finally:
        holder.rollback()
        holder.close()
    for t in threads:
        t.join(15)
    assert not errors, errors
    second = live_run(job.pk)
    assert second.pk != job.pk and second.run_number == 2
    assert list(JobSignal.objects.values_list("job_id", flat=True)) == [second.pk]
    assert drive(job.pk).result == {"at": "switch"}


def test_a_renamed_step_under_a_parked_job_fails_with_nondeterministic_replay():
    VERSION["v"] = 1
    try:
        job, _ = services.submit("durable.versioned", {"sleep": 0})
        run_once(job.pk)  # a, b, then parks at the sleep
        VERSION["v"] = 2  # deploy: step "b" renamed
        assert run_once(job.pk) == OutcomeKind.FAIL
        job.refresh_from_db()
        assert job.status == "failed" and job.retry_count == 0
        assert "nondeterministic replay: history entry #2 is 'b'" in job.error
        assert "the code asked for 'b-renamed'" in job.error
    finally:
        VERSION["v"] = 1


def test_patched_sends_old_runs_down_the_old_branch_and_new_runs_down_the_new():
    VERSION["v"] = 1
    try:
        old, _ = services.submit("durable.versioned", {"sleep": 0})
        run_once(old.pk)  # parked past "b" under the old code
        VERSION["v"] = 3  # deploy: the change behind ctx.patched("new-b")
        new, _ = services.submit("durable.versioned", {"sleep": 0})
        assert drive(old.pk).result == {"a": "a", "b": "old", "c": "c"}
        assert drive(new.pk).result == {"a": "a", "b": "new", "c": "c"}
        names = list(
            JobStep.objects.filter(job_id=new.pk).order_by("id").values_list("name", flat=True)
        )
        assert names == ["a", "~patch:new-b", "b-new", "~sleep:1", "c"]
    finally:
        VERSION["v"] = 1


def test_the_order_check_can_be_turned_off_by_the_handler():
    job, _ = services.submit("durable.five_steps", {"dir": "/tmp"})
    lease = services.claim("w-x", job.pk)
    ctx = durable.context(lease)
    ctx.step("s1", lambda: 1)
    ctx.step("s2", lambda: 2)
    services.release([lease])
    lease = services.claim("w-y", job.pk)
    ctx = durable.context(lease)
    with pytest.raises(durable.NondeterministicReplay):
        ctx.step("s2", lambda: 0)
    ctx = durable.context(lease)
    ctx.check_replay = False
    assert ctx.step("s2", lambda: 0) == 2


def test_the_history_gauges_read_the_largest_live_history_and_old_open_waits(settings):
    from jobs.collectors import DurableHistoryCollector
    from jobs.lifecycle import BLOCKED_RUN_AT, WaitReason

    big, _ = services.submit("echo", {})
    small, _ = services.submit("echo", {})
    for job, n in ((big, 3), (small, 1)):
        lease = services.claim("w-g", job.pk)
        for i in range(n):
            assert services.checkpoint_step(lease, f"s{i}", '"x"')
        services.suspend(lease, reason=WaitReason.SIGNAL, key="k", until=BLOCKED_RUN_AT,
                         checkpoint="~wait:k")  # fmt: skip

    def read() -> dict[str, float]:
        collector = DurableHistoryCollector(cache_seconds=0)
        return {f.name: f.samples[0].value for f in collector.collect()}

    gauges = read()
    assert gauges["jobs_durable_history_steps_max"] == 4  # 3 steps and the wait
    assert gauges["jobs_durable_history_bytes_max"] > 0
    assert gauges["jobs_durable_history_limit"] == settings.JOBS_MAX_STEPS
    assert gauges["jobs_durable_open_waits"] == 0
    Job.objects.filter(pk=small.pk).update(created_at="2000-01-01T00:00:00Z")
    assert read()["jobs_durable_open_waits"] == 1
