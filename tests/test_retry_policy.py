"""Retry policies are checked when the decorator runs (at import), and decide as documented."""

from __future__ import annotations

import pytest

from jobs import backends
from jobs.retries import RetryPolicy
from jobs.tasks import RetryableError, task


@pytest.mark.parametrize(
    "options",
    [
        {"retry_on": (1,)},
        {"retry_on": "TimeoutError"},
        {"give_up_on": (ValueError, "x")},
        {"backoff": (1.0,)},
        {"backoff": (5.0, 1.0, 0.0)},
        {"backoff": (1.0, 2.0, 1.5)},
        {"backoff": (-1.0, 2.0, 0.0)},
        {"backoff": (1.0, float("inf"), 0.0)},
        {"backoff": "fast"},
    ],
)
def test_a_policy_that_cannot_work_is_refused_at_import(options):
    with pytest.raises((TypeError, ValueError)):
        task("policy.refused", **options)
    with pytest.raises((TypeError, ValueError)):
        backends.retry_policy(**options)


def test_no_policy_leaves_the_defaults():
    assert RetryPolicy.build() is None


def test_decisions():
    policy = RetryPolicy.build(
        retry_on=(TimeoutError,), give_up_on=(ConnectionRefusedError,), backoff=(1.0, 5.0, 0.0)
    )
    assert [policy.decide(TimeoutError(), n).delay for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    assert policy.decide(RetryableError(), 1).give_up is False  # an explicit ask still retries
    assert policy.decide(ValueError(), 1).give_up is True
    assert policy.decide(ConnectionRefusedError(), 1).give_up is True
    jittered = RetryPolicy.build(backoff=(4.0, 4.0, 0.5))
    assert all(2.0 <= jittered.decide(OSError(), 1).delay <= 4.0 for _ in range(50))
    called = RetryPolicy.build(backoff=lambda retry: 7.0 * retry)
    assert called.decide(OSError(), 3).delay == 21.0
