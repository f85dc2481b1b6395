"""An idle worker's hand-off (D74): after claiming for an idle worker, the dispatcher
steps aside until the job's write-back has started, so the handler and the flusher do
not wait for the GIL behind the dispatcher's way back to the next pop."""

from __future__ import annotations

import faulthandler
import sys
import threading
import time

import pytest

from jobs import services
from jobs import worker as worker_mod
from jobs.models import Job
from jobs.worker import Worker
from tests.harness import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def _recording(w: Worker, monkeypatch) -> list[tuple]:
    """(event, monotonic time, job ids) for the worker's claims handed over, its pops and
    its write-backs, in the order they began."""
    events: list[tuple] = []
    pop, start, write_back = w.transport.pop, w._start, w._write_back

    def recording_pop(*args, **kwargs):
        events.append(("pop", time.monotonic(), []))
        return pop(*args, **kwargs)

    def recording_start(leases, **kwargs):
        events.append(("start", time.monotonic(), [lease.job_id for lease in leases]))
        return start(leases, **kwargs)

    def recording_write_back(batch):
        events.append(("write", time.monotonic(), [o.lease.job_id for o in batch]))
        return write_back(batch)

    monkeypatch.setattr(w.transport, "pop", recording_pop)
    monkeypatch.setattr(w, "_start", recording_start)
    monkeypatch.setattr(w, "_write_back", recording_write_back)
    return events


def _running(w: Worker) -> threading.Thread:
    thread = threading.Thread(target=w.run, name="worker-under-test", daemon=True)
    thread.start()
    return thread


def _stop(w: Worker, thread: threading.Thread) -> None:
    w.request_stop()
    thread.join(timeout=30)
    if thread.is_alive():  # show where it hangs
        faulthandler.dump_traceback(sys.stderr)
    assert not thread.is_alive()


def test_an_idle_worker_pops_again_only_once_the_jobs_write_back_started(monkeypatch):
    # A bound far beyond the test's waits: only the write-back's start may end the wait.
    monkeypatch.setattr(worker_mod, "IDLE_HANDOFF_WAIT", 60.0)
    w = Worker(concurrency=2, worker_id="w-handoff", poll_interval=0.2)
    events = _recording(w, monkeypatch)
    thread = _running(w)
    try:
        jobs = []
        for _ in range(3):
            job, _ = services.submit("echo", {"n": len(jobs)})
            jobs.append(job.pk)
            wait_until(
                lambda pk=job.pk: Job.objects.get(pk=pk).status == "done", 20, message="done"
            )
            wait_until(lambda: events[-1][0] == "pop", 20, message="back at the pop")
    finally:
        _stop(w, thread)
    for pk in jobs:
        handed = next(i for i, e in enumerate(events) if e[0] == "start" and pk in e[2])
        after = [e for e in events[handed + 1 :] if e[0] in ("pop", "write")]
        # Before D74 the dispatcher was back at the pop while the job still waited for
        # a handler: the write-back came after it.
        assert after[0][0] == "write" and pk in after[0][2], events[handed:]
        assert after[1][0] == "pop"
        assert after[1][1] - after[0][1] < 10  # woken by the write-back, not the bound


def test_a_long_job_holds_an_idle_worker_back_no_longer_than_the_bound():
    w = Worker(concurrency=2, worker_id="w-long", poll_interval=0.2)
    thread = _running(w)
    try:
        long, _ = services.submit("sleep", {"seconds": 5})
        wait_until(lambda: Job.objects.get(pk=long.pk).status == "processing", 20)
        short, _ = services.submit("echo", {})
        wait_until(lambda: Job.objects.get(pk=short.pk).status == "done", 4)
        assert Job.objects.get(pk=long.pk).status == "processing"
    finally:
        _stop(w, thread)


def test_a_busy_worker_hands_over_without_waiting(monkeypatch):
    """Under load (leases already held) a claim is handed over at once: the batching of
    claims and write-backs under load is unchanged."""
    monkeypatch.setattr(worker_mod, "IDLE_HANDOFF_WAIT", 0.2)
    w = Worker(concurrency=2, worker_id="w-busy")
    for _ in range(2):
        services.submit("echo", {})
    first, second = services.claim_next(w.worker_id, ["default"], 2)
    w._start([first])  # idle: nothing else held; no flusher runs, so the bound ends it
    monkeypatch.setattr(worker_mod, "IDLE_HANDOFF_WAIT", 60.0)  # a wait now would show
    started = time.monotonic()
    w._start([second])
    assert time.monotonic() - started < 5
    assert w.inflight == 2


def test_an_idle_workers_wait_is_bounded(monkeypatch):
    monkeypatch.setattr(worker_mod, "IDLE_HANDOFF_WAIT", 0.3)
    w = Worker(concurrency=2, worker_id="w-bound")
    services.submit("echo", {})
    started = time.monotonic()
    w._start(services.claim_next(w.worker_id, ["default"], 1))  # no flusher: the bound
    assert 0.3 <= time.monotonic() - started < 10
