"""Schedules fired by real runreaper processes (docs/schedules.md).

Three reapers race for every slot of a 1-second interval, a 5-second cron and a
per-minute cron, one of them kill -9ed and replaced midway: every slot has one
scheduler_runs row and one job, none is lost, and consecutive jobs of the 1-second
schedule are at most two seconds apart. `make test` runs it for SCHEDULE_E2E_SECONDS
(default 25); `make schedules-long` for the full two minutes. The downtime test stops
every reaper for SCHEDULE_DOWNTIME_SECONDS (default 12: nine missed slots or more, the
same proof as a longer stop).
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import datetime, timedelta

import pytest

from jobs.models import Job, JobEvent, Schedule, SchedulerRun
from jobs.schedules import define
from tests.factories import raw
from tests.harness import wait_until

pytestmark = pytest.mark.slow

RUN_SECONDS = float(os.environ.get("SCHEDULE_E2E_SECONDS", "25"))
DOWNTIME_SECONDS = float(os.environ.get("SCHEDULE_DOWNTIME_SECONDS", "12"))


def make(name: str, **values) -> Schedule:
    return define.create(
        {"name": name, "task": "echo", "payload": {"s": name}, **values},
        client=None,
        origin=Schedule.Origin.ADMIN,
    )


def db_now() -> datetime:
    return raw("SELECT now()")[0][0]


def fire_times(schedule: Schedule) -> list[datetime]:
    return list(
        SchedulerRun.objects.filter(schedule=schedule, manual=False)
        .order_by("fire_time")
        .values_list("fire_time", flat=True)
    )


def assert_one_job_per_run(schedule: Schedule) -> None:
    """Every run row made exactly one job, carrying that run's fire time."""
    runs = dict(SchedulerRun.objects.filter(schedule=schedule).values_list("fire_time", "job_id"))
    jobs = dict(Job.objects.filter(schedule=schedule).values_list("fire_time", "id"))
    assert None not in runs.values()
    assert runs == jobs  # same slots, same ids: no run without its job, no job twice
    assert Job.objects.filter(schedule=schedule).count() == len(runs)


def expected_slots(first: datetime, step: timedelta, until: datetime) -> list[datetime]:
    out, t = [], first
    while t <= until:
        out.append(t)
        t += step
    return out


def started(reaper):
    wait_until(lambda: "reaper started" in reaper.output(), 60, "reaper to start", interval=0.05)
    return reaper


def test_three_reapers_fire_every_slot_exactly_once(stack):
    reapers = [started(stack.reaper()) for _ in range(3)]
    every_second = make("every-second", interval_seconds=1)
    every_5s = make("every-5s", cron="*/5 * * * * *")
    every_minute = make("every-minute", cron="* * * * *")
    firsts = {s.pk: s.next_fire_at for s in (every_second, every_5s, every_minute)}
    started_at = time.monotonic()
    wait_until(lambda: len(fire_times(every_second)) >= 2, 60, "the first slots")
    time.sleep(max(0.0, RUN_SECONDS / 3 - (time.monotonic() - started_at)))
    reapers[0].kill()  # kill -9 one replica mid-run; a new one takes its place
    reapers.append(stack.reaper())
    time.sleep(max(0.0, RUN_SECONDS - (time.monotonic() - started_at)))
    end = db_now()
    for r in reapers:
        r.stop()

    # Every slot up to two seconds before the end fired; none twice; one job each.
    margin = end - timedelta(seconds=2)
    times = fire_times(every_second)
    wanted = expected_slots(firsts[every_second.pk], timedelta(seconds=1), margin)
    assert times[: len(wanted)] == wanted
    assert len(wanted) >= RUN_SECONDS - 5
    times_5s = fire_times(every_5s)
    assert all(t.second % 5 == 0 and t.microsecond == 0 for t in times_5s)
    wanted_5s = expected_slots(firsts[every_5s.pk], timedelta(seconds=5), margin)
    assert times_5s[: len(wanted_5s)] == wanted_5s
    times_min = fire_times(every_minute)
    wanted_min = expected_slots(firsts[every_minute.pk], timedelta(minutes=1), margin)
    assert times_min[: len(wanted_min)] == wanted_min
    for s in (every_second, every_5s, every_minute):
        assert_one_job_per_run(s)

    # No gap longer than two seconds between consecutive jobs of the 1-second schedule.
    created = list(
        Job.objects.filter(schedule=every_second)
        .order_by("fire_time")
        .values_list("created_at", "fire_time")
    )
    gaps = [(b[0] - a[0]).total_seconds() for a, b in zip(created, created[1:], strict=False)]
    lags = [(c - f).total_seconds() for c, f in created]
    print(
        f"{len(created)} jobs of the 1 s schedule: gap max {max(gaps):.3f} s, "
        f"lag p50 {statistics.median(lags):.3f} s max {max(lags):.3f} s; "
        f"{len(times_5s)} of the 5 s cron, {len(times_min)} of the minute cron"
    )
    assert max(gaps) <= 2.0


def test_downtime_skip_makes_one_job_all_makes_each_missed_slot(stack):
    reapers = [started(stack.reaper()) for _ in range(2)]
    skip = make("skip", interval_seconds=1, catch_up="skip")
    every = make("all", interval_seconds=1, catch_up="all")
    wait_until(lambda: len(fire_times(every)) >= 3, 60, "slots before the downtime")
    for r in reapers:
        r.stop()
    down_from = db_now()
    time.sleep(DOWNTIME_SECONDS)
    down_until = db_now()
    reapers = [stack.reaper() for _ in range(2)]
    wait_until(
        lambda: fire_times(every) and fire_times(every)[-1] > down_until + timedelta(seconds=2),
        60,
        "slots after the restart",
    )
    for r in reapers:
        r.stop()

    # skip: one job for the whole missed period, then the schedule goes on.
    times = fire_times(skip)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    long = [g for g in gaps if g > timedelta(seconds=1)]
    assert len(long) == 1 and long[0] >= timedelta(seconds=DOWNTIME_SECONDS - 3), gaps
    in_downtime = [t for t in times if down_from + timedelta(seconds=1) < t < down_until]
    assert len(in_downtime) <= 1
    # all: every slot, the missed ones included, exactly once.
    times = fire_times(every)
    assert all(b - a == timedelta(seconds=1) for a, b in zip(times, times[1:], strict=False))
    missed = [t for t in times if down_from + timedelta(seconds=1) < t < down_until]
    assert len(missed) >= DOWNTIME_SECONDS - 3
    for s in (skip, every):
        assert_one_job_per_run(s)
    print(f"downtime {(down_until - down_from).total_seconds():.1f} s: all made {len(missed)}")


def test_overlap_skip_never_runs_two_at_once(stack):
    """A 1-second schedule of a 3-second job: with overlap skip, runs never overlap."""
    s = make("slow", interval_seconds=1, overlap="skip", task="sleep", payload={"seconds": 3})
    stack.worker("--concurrency", "4")
    stack.reaper()
    wait_until(
        lambda: Job.objects.filter(schedule=s, status="done").count() >= 2, 60, "two runs done"
    )
    stack.stop_all()
    spans = []
    for job in Job.objects.filter(schedule=s).order_by("id"):
        events = JobEvent.objects.filter(job_id=job.pk).order_by("id")
        start = next((e.at for e in events if e.to_status == "processing"), None)
        end = next((e.at for e in events if e.from_status == "processing"), None)
        if start is not None:
            spans.append((start, end or db_now()))
    assert len(spans) >= 2
    for (_, end_a), (start_b, _) in zip(spans, spans[1:], strict=False):
        assert start_b >= end_a, spans
    assert SchedulerRun.objects.filter(schedule=s, job_id__isnull=True).count() >= 2
    assert_one_job_per_run_or_skipped(s)


def assert_one_job_per_run_or_skipped(schedule: Schedule) -> None:
    runs = dict(
        SchedulerRun.objects.filter(schedule=schedule, job_id__isnull=False).values_list(
            "fire_time", "job_id"
        )
    )
    assert runs == dict(Job.objects.filter(schedule=schedule).values_list("fire_time", "id"))


def test_the_reaper_exports_schedule_lag_and_its_scheduler_tick(stack):
    from tests.harness import free_port
    from tests.scrape import port_scrape

    port = free_port()
    reaper = started(stack.reaper("--metrics-port", str(port)))
    make("metered", interval_seconds=1)
    wait_until(lambda: port_scrape(port).value("jobs_schedule_lag_seconds_count") >= 2, 30, "lag")
    got = port_scrape(port)
    assert got.value("jobs_schedule_slots_total", outcome="enqueued") >= 2
    assert got.value("jobs_scheduler_last_tick_timestamp_seconds") > time.time() - 30
    assert got.value("jobs_schedule_overdue_seconds") < 5
    assert (
        got.value("jobs_schedule_lag_seconds_sum") / got.value("jobs_schedule_lag_seconds_count")
        < 5
    )
    reaper.stop()


def test_a_frozen_scheduler_holds_no_slot_for_long(stack):
    """SIGSTOP one of two reapers for 10 s, twice: a transaction it froze in is ended by
    PostgreSQL after 5 s (no pause reaches the freeze's length), the other fires on, and
    with catch_up all every slot still has exactly one job."""
    import signal

    reapers = [started(stack.reaper()) for _ in range(2)]
    s = make("frozen", interval_seconds=1, catch_up="all")
    first = s.next_fire_at
    for _ in range(2):
        time.sleep(2)
        reapers[0].signal(signal.SIGSTOP)
        time.sleep(10)
        reapers[0].signal(signal.SIGCONT)
    time.sleep(2)
    end = db_now()
    for r in reapers:
        r.stop()
    times = fire_times(s)
    wanted = expected_slots(first, timedelta(seconds=1), end - timedelta(seconds=10))
    assert times[: len(wanted)] == wanted
    assert_one_job_per_run(s)
    created = list(
        Job.objects.filter(schedule=s).order_by("created_at").values_list("created_at", flat=True)
    )
    gaps = [(b - a).total_seconds() for a, b in zip(created, created[1:], strict=False)]
    print(f"{len(created)} jobs with one reaper frozen 2 x 10 s: longest pause {max(gaps):.2f} s")
    assert max(gaps) <= 8.0
