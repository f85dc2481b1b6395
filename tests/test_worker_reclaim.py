"""A claim lost in a database crash and made again by the same worker yields a lease the
worker already holds in flight: it is not started a second time (D247)."""

from __future__ import annotations

import logging

import pytest
from django.db import transaction

from jobs import services
from jobs.worker import Worker
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db


def test_a_lease_already_in_flight_is_not_started_again(caplog):
    worker = Worker(worker_id="w-again")
    job = JobFactory.create(task="echo")
    with transaction.atomic():
        lost = services.claim("w-again", job.pk)
        transaction.set_rollback(True)  # what a crash does to an unflushed claim
    worker._start([lost])
    again = services.claim("w-again", job.pk)
    assert again.lease_version == lost.lease_version  # the same key, the same owner
    with caplog.at_level(logging.WARNING, logger="jobs.worker"):
        worker._start([again])
    assert worker._waiting == 1 and len(worker._inflight) == 1 and len(worker._heap) == 1
    assert worker._ready.qsize() == 1  # one handler call for the job, not two
    assert [r.job_id for r in caplog.records if "claimed again" in r.getMessage()] == [job.pk]
