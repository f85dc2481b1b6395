"""The pools' small parts, without a worker process (tests/test_process_pool_e2e.py runs
real ones)."""

from __future__ import annotations

import signal

import pytest

from jobs.tasks import JobContext
from jobs.worker import Worker
from jobs.worker.pools import Pool, make
from jobs.worker.pools.processes import ProcessPool, exit_description, flags
from jobs.worker.pools.threads import ThreadPool


def context() -> JobContext:
    return JobContext(job_id=1, lease_version=1, attempt=1, worker_id="w", queue="q", task="t")


def test_exit_descriptions_name_the_signal():
    assert exit_description(-signal.SIGKILL) == "signal 9 (SIGKILL)"
    assert exit_description(-signal.SIGSEGV) == "signal 11 (SIGSEGV)"
    assert exit_description(1) == "exit code 1"
    assert exit_description(None) == "unknown status"


def test_forwarding_the_flags_does_not_count_as_the_handler_seeing_a_cancel():
    ctx = context()
    ctx.request_cancel()
    assert flags(ctx) == (True, False, True, False)
    assert not ctx.cancel_seen  # only the child's handler looking at it counts


@pytest.mark.parametrize(("kind", "cls"), [("threads", ThreadPool), ("processes", ProcessPool)])
def test_both_pools_implement_the_interface(kind, cls):
    worker = Worker(concurrency=3, pool=kind, worker_id="w-pool")
    assert isinstance(worker.pool, cls)
    assert worker.pool.kind == kind and worker.pool.capacity == 3
    for name in ("start", "replaces", "write_off", "stop", "alive"):
        assert callable(getattr(worker.pool, name))
    assert set(Pool.__dict__) >= {"start", "replaces", "write_off", "stop", "alive"}


def test_an_unknown_pool_is_refused():
    with pytest.raises(ValueError, match="threads, processes"):
        make("greenlets", None)
