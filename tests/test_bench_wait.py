"""The bench's wait for a scenario's jobs, against real PostgreSQL: a scenario whose jobs
make jobs of their own (webhook deliveries) must not take those for its own.

`webhook-throughput` once counted 9,727 `done` events for 10,000 jobs whose receiver got
all 10,000 calls: it waited for any 10,000 terminal jobs, finished deliveries among
them, and read the jobs' events while 273 of them still ran (no event was lost)."""

from __future__ import annotations

import pytest

from bench.scenarios import wait_terminal
from jobs import services

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_wait_for_named_jobs_does_not_count_other_finished_jobs():
    mine = [services.submit("echo", {"n": i})[0].pk for i in range(2)]
    services.complete([(services.claim("w1", mine[0]), {})])
    for i in range(3):  # others' jobs, finished: deliveries, say
        other = services.submit("echo", {"other": i})[0].pk
        services.complete([(services.claim("w1", other), {})])
    with pytest.raises(TimeoutError):
        wait_terminal(2, timeout=0.3, job_ids=mine)
    wait_terminal(2, timeout=0.3)  # any two: what the scenarios waited for before
    services.complete([(services.claim("w1", mine[1]), {})])
    wait_terminal(2, timeout=5, job_ids=mine)
