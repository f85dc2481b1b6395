"""Failed attempts are logged with their traceback at WARNING, rate-limited per task:
5 at once, then one per 12 s; beyond that one INFO line each (issue 21.2)."""

from __future__ import annotations

import logging
import re

import pytest

from jobs import services
from jobs.errors import TRACEBACK_CHARS, PerKeyRateLimit, format_traceback, storable
from jobs.worker import Worker
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db


def _raise(depth: int) -> None:
    if depth:
        _raise(depth - 1)
    raise ValueError("deep\x00down")


def _failure(depth: int = 0) -> ValueError:
    try:
        _raise(depth)
    except ValueError as exc:
        return exc
    raise AssertionError("unreachable")


def test_tracebacks_are_rate_limited_per_task_and_the_rest_still_logged(caplog):
    worker = Worker(worker_id="w-log")
    noisy = services.claim("w-log", JobFactory.create(task="fail").pk)
    quiet = services.claim("w-log", JobFactory.create(task="echo").pk)
    with caplog.at_level(logging.INFO, logger="jobs.worker"):
        for _ in range(8):
            worker._failed(noisy, _failure(), False)
        worker._failed(quiet, _failure(), False)
    records = [(r.levelno, r.task, r.exc_info is not None) for r in caplog.records]
    assert records == [
        *[(logging.WARNING, "fail", True)] * 5,
        *[(logging.INFO, "fail", False)] * 3,
        (logging.WARNING, "echo", True),  # another task has its own budget
    ]
    assert all(r.job_id and r.lease_version and r.worker_id for r in caplog.records)


def test_rate_limit_refills_and_reports_what_it_held_back(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("jobs.errors.time.monotonic", lambda: clock[0])
    limit = PerKeyRateLimit(burst=2, every=10.0)
    assert [limit.allow("t") for _ in range(4)] == [(True, 0), (True, 0), (False, 0), (False, 0)]
    clock[0] += 10.0
    assert limit.allow("t") == (True, 2)  # one token back; two were held back meanwhile
    assert limit.allow("t") == (False, 0)


def test_traceback_keeps_the_last_30_frames_and_at_most_8_kib():
    deep = format_traceback(_failure(depth=200))
    assert deep.startswith("Traceback (most recent call last):")
    frames = re.findall(r'File ".*", line \d+, in (\w+)', deep)
    repeated = re.search(r"Previous line repeated (\d+) more times", deep)
    assert len(frames) + (int(repeated.group(1)) if repeated else 0) == 30
    assert deep.rstrip().endswith("ValueError: deep\\x00down")  # NUL escaped, not dropped
    long = format_traceback(ValueError("x" * 20_000))
    assert len(long) == TRACEBACK_CHARS
    assert long.startswith("…(traceback truncated)") and long.endswith("x\n")
    assert storable("caf\udce9 \x00") == "caf\\udce9 \\x00"


def test_the_text_format_names_the_job_on_the_message_line_before_the_traceback():
    """The fields came after the traceback: `grep 'attempt failed'` found no job id."""
    from jobs.logconfig import TextFormatter, job_log_fields

    try:
        _raise(0)
    except ValueError as exc:
        error = exc
    record = logging.makeLogRecord({
        "name": "jobs.worker.attempts", "levelno": logging.WARNING, "levelname": "WARNING",
        "msg": "attempt failed: %s", "args": ("ValueError: deep",),
        "exc_info": (ValueError, error, error.__traceback__),
        **job_log_fields(7, 1, "host:1:ab", "default", "shop.tasks.add"),
    })  # fmt: skip
    first, *rest = TextFormatter().format(record).splitlines()
    assert first.endswith(
        "attempt failed: ValueError: deep job_id=7 lease_version=1 worker_id=host:1:ab "
        "queue=default task=shop.tasks.add"
    ), first
    assert rest[0] == "Traceback (most recent call last):" and "job_id" not in rest[-1]
