"""The process runtime's stop requests and backoff (jobs.runtime)."""

from __future__ import annotations

import pytest

from jobs.runtime import Backoff, ColdStop, StopRequests


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
