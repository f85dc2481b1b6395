"""The process runtime's stop requests and backoff (jobs.runtime)."""

from __future__ import annotations

import pytest

from jobs.runtime import Backoff, ColdStop, StopRequests
from jobs.transport import get_transport
from jobs.worker import Worker
from tests.factories import JobFactory


def test_first_request_is_warm_second_raises_cold_stop_with_exit_code_130():
    calls = []
    stops = StopRequests(lambda: calls.append("warm"), lambda: calls.append("cold"))
    stops.request()
    assert calls == ["warm"] and not stops.cold
    with pytest.raises(ColdStop) as raised:
        stops.request()
    assert calls == ["warm", "cold"] and stops.cold
    assert isinstance(raised.value, SystemExit) and raised.value.code == 130


def test_cold_stop_runs_finally_blocks():
    stops = StopRequests(lambda: None)
    cleaned = []
    stops.request()
    with pytest.raises(ColdStop):
        try:
            stops.request()
        finally:
            cleaned.append(True)
    assert cleaned == [True]


def test_backoff_doubles_up_to_its_maximum_and_resets():
    backoff = Backoff(0.5, 3.0)
    assert [backoff.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next() == 0.5


def test_backoff_says_whether_there_is_anything_to_reset():
    backoff = Backoff(0.5, 3.0)
    assert not backoff.backing_off
    backoff.next()
    assert backoff.backing_off
    backoff.reset()
    assert not backoff.backing_off and backoff.next() == 0.5


@pytest.mark.django_db
def test_a_worker_that_backed_off_starts_again_from_the_first_wait_after_a_success():
    """The worker resets a backoff only when it backed off (D372): after a Redis pop and a
    claim that succeed, both start again from their first wait."""
    job = JobFactory.create()
    get_transport().push({"default": [job.pk]})
    worker = Worker(["default"], concurrency=1)
    for backoff in (worker._redis_backoff, worker._db_backoff):
        backoff.next(), backoff.next()  # two failures
    assert [lease.job_id for lease in worker._discover(1, 1)] == [job.pk]
    for backoff in (worker._redis_backoff, worker._db_backoff):
        assert not backoff.backing_off and backoff.current == backoff.initial
