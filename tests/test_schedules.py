"""Schedules against the real database: a slot fires once whoever races for it,
catch-up after downtime, overlap `skip`, daylight-saving slots, @periodic sync."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connections, transaction

from jobs.exceptions import SubmissionError
from jobs.models import Job, Schedule, SchedulerRun
from jobs.schedules import define, firing, periodic
from jobs.schedules.scheduler import Scheduler
from jobs.schedules.timing import Timing
from jobs.transport import get_transport
from tests.factories import raw
from tests.race import race


def make(**values) -> Schedule:
    base = {"name": "every-second", "interval_seconds": 1, "task": "echo", "payload": {"n": 1}}
    return define.create({**base, **values}, client=None, origin=Schedule.Origin.ADMIN)


def backdate(schedule: Schedule, seconds: float) -> None:
    """As if every scheduler had been down: the next slot lies `seconds` in the past."""
    raw(
        "UPDATE jobs_schedule SET next_fire_at = now() - make_interval(secs => %s) WHERE id = %s",
        [seconds, schedule.pk],
    )


def jobs_of(schedule: Schedule) -> list[Job]:
    return list(Job.objects.filter(schedule=schedule).order_by("fire_time"))


@pytest.mark.django_db
def test_a_due_slot_makes_one_job_carrying_its_schedule_and_fire_time():
    s = make()
    backdate(s, 0)
    report = Scheduler().tick()
    assert (report.schedules, report.jobs) == (1, 1)
    (job,) = jobs_of(s)
    run = SchedulerRun.objects.get(schedule=s)
    assert (job.task, job.payload, job.status) == ("echo", {"n": 1}, "queued")
    assert job.fire_time == run.fire_time and run.job_id == job.pk
    s.refresh_from_db()
    assert s.last_fire_at == run.fire_time
    assert s.next_fire_at == run.fire_time + timedelta(seconds=1)
    assert Scheduler().tick().jobs == 0  # nothing due until the next slot


@pytest.mark.django_db(transaction=True)
def test_the_job_is_signalled_after_commit():
    s = make()
    backdate(s, 0)
    Scheduler().tick()
    (job,) = jobs_of(s)
    t = get_transport()
    assert [int(x) for x in t._client.lrange(t.key("default"), 0, -1)] == [job.pk]


@pytest.mark.django_db(transaction=True)
def test_schedulers_racing_for_one_slot_make_one_job():
    """Eight real connections fire the same slot at once: one run row, one job."""
    s = make()
    slot = datetime(2030, 1, 1, tzinfo=UTC)
    n = 8

    def fire(i: int, go) -> bool:
        go()
        with transaction.atomic(durable=True):
            return firing.fire_slot(s.pk, slot) is not None

    won = race(n, fire)
    assert sorted(won) == [False] * (n - 1) + [True], won
    assert SchedulerRun.objects.filter(schedule=s).count() == 1
    assert Job.objects.filter(schedule=s).count() == 1


@pytest.mark.django_db
def test_a_rolled_back_slot_leaves_neither_run_nor_job():
    s = make()
    with pytest.raises(RuntimeError), transaction.atomic():
        assert firing.fire_slot(s.pk, datetime(2030, 1, 1, tzinfo=UTC)) is not None
        raise RuntimeError("crash before commit")
    assert not SchedulerRun.objects.exists() and not Job.objects.exists()
    with transaction.atomic():
        assert firing.fire_slot(s.pk, datetime(2030, 1, 1, tzinfo=UTC)) is not None
    assert Job.objects.filter(schedule=s).count() == 1


@pytest.mark.django_db
def test_catch_up_skip_makes_one_job_for_the_missed_period():
    s = make(catch_up="skip")
    backdate(s, 30)
    Scheduler().tick()
    (job,) = jobs_of(s)
    s.refresh_from_db()
    assert s.next_fire_at == job.fire_time + timedelta(seconds=1)
    assert s.next_fire_at > raw("SELECT now()")[0][0]


@pytest.mark.django_db
def test_catch_up_all_makes_each_missed_slot_once():
    s = make(catch_up="all")
    backdate(s, 30)
    Scheduler().tick()
    times = [j.fire_time for j in jobs_of(s)]
    assert len(times) == 31
    assert all(b - a == timedelta(seconds=1) for a, b in zip(times, times[1:], strict=False))
    Scheduler().tick()  # nothing twice
    assert (
        Job.objects.filter(schedule=s).count()
        == len(set(times))
        == len(set(Job.objects.filter(schedule=s).values_list("fire_time", flat=True)))
    )


@pytest.mark.django_db
def test_catch_up_all_is_bounded(settings):
    settings.JOBS_SCHEDULE_CATCH_UP_MAX = 5
    s = make(catch_up="all")
    backdate(s, 60)
    Scheduler().tick()
    times = [j.fire_time for j in jobs_of(s)]
    assert len(times) == 5
    assert times[-1] > raw("SELECT now() - interval '2 seconds'")[0][0]  # the latest five


@pytest.mark.django_db(transaction=True)
def test_overlap_skip_passes_over_slots_while_the_previous_run_is_live():
    s = make(overlap="skip")
    backdate(s, 0)
    Scheduler().tick()
    (first,) = jobs_of(s)
    backdate(s, 0)
    Scheduler().tick()
    assert len(jobs_of(s)) == 1
    skipped = SchedulerRun.objects.filter(schedule=s, job_id__isnull=True)
    assert skipped.count() == 1
    raw(
        "UPDATE jobs_job SET status = 'failed', error = 'x', finished_at = now() WHERE id = %s",
        [first.pk],
    )
    backdate(s, 0)
    Scheduler().tick()
    assert len(jobs_of(s)) == 2


@pytest.mark.django_db(transaction=True)
def test_overlap_allow_fires_while_the_previous_run_is_live():
    s = make(overlap="allow")
    for _ in range(2):
        backdate(s, 0)
        Scheduler().tick()
    assert len(jobs_of(s)) == 2


@pytest.mark.django_db
def test_a_paused_schedule_does_not_fire_and_resumes_from_now():
    s = make()
    define.update(s, {"enabled": False})
    backdate(s, 30)
    Scheduler().tick()
    assert not jobs_of(s)
    define.update(s, {"enabled": True})
    s.refresh_from_db()
    assert s.next_fire_at > raw("SELECT now()")[0][0]  # no catch-up for the pause


@pytest.mark.django_db
def test_run_now_makes_a_job_whatever_the_overlap():
    s = make(overlap="skip")
    with transaction.atomic():
        a = firing.run_now(s.pk, "staff:ann")
    with transaction.atomic():
        b = firing.run_now(s.pk, "staff:ann")
    assert a.job_id and b.job_id and a.job_id != b.job_id
    assert SchedulerRun.objects.filter(schedule=s, manual=True).count() == 2


# --- daylight saving (Europe/Berlin: 2026-03-29 02:00 → 03:00, 2026-10-25 03:00 → 02:00)


BERLIN = "Europe/Berlin"


def utc(*args) -> datetime:
    return datetime(*args, tzinfo=UTC)


def slots(rule: Timing, start: datetime, n: int) -> list[datetime]:
    out, t = [], start
    for _ in range(n):
        t = rule.next_after(t)
        out.append(t)
    return out


def test_dst_a_daily_time_in_the_skipped_hour_fires_once_shifted_by_the_gap():
    rule = Timing("30 2 * * *", None, BERLIN)
    # 28 Mar 02:30 CET = 01:30Z; 29 Mar 02:30 does not exist: 03:30 CEST = 01:30Z;
    # 30 Mar 02:30 CEST = 00:30Z.
    assert slots(rule, utc(2026, 3, 28, 0), 3) == [
        utc(2026, 3, 28, 1, 30),
        utc(2026, 3, 29, 1, 30),
        utc(2026, 3, 30, 0, 30),
    ]


def test_dst_a_daily_time_in_the_repeated_hour_fires_once_at_its_first_occurrence():
    rule = Timing("30 2 * * *", None, BERLIN)
    # 25 Oct 02:30 happens at 00:30Z (CEST) and again at 01:30Z (CET): once, the first.
    assert slots(rule, utc(2026, 10, 24, 12), 2) == [
        utc(2026, 10, 25, 0, 30),
        utc(2026, 10, 26, 1, 30),
    ]


def test_dst_half_hourly_slots_across_both_changes_are_distinct_and_increasing():
    rule = Timing("*/30 * * * *", None, BERLIN)
    spring = slots(rule, utc(2026, 3, 29, 0), 4)
    # 01:30 CET, then 03:00 and 03:30 CEST: the skipped 02:00 and 02:30 map onto them.
    assert spring == [utc(2026, 3, 29, 0, 30), utc(2026, 3, 29, 1), utc(2026, 3, 29, 1, 30),
                      utc(2026, 3, 29, 2)]  # fmt: skip
    autumn = slots(rule, utc(2026, 10, 24, 23, 45), 4)
    # 02:00 and 02:30 CEST, then 03:00 CET: the repeated 02:00-03:00 CET does not fire again.
    assert autumn == [utc(2026, 10, 25, 0), utc(2026, 10, 25, 0, 30), utc(2026, 10, 25, 2),
                      utc(2026, 10, 25, 2, 30)]  # fmt: skip


def test_dst_catch_up_across_the_change_counts_each_wall_time_once():
    rule = Timing("0 * * * *", None, BERLIN)
    missed, following = rule.due(utc(2026, 10, 24, 22, 30), utc(2026, 10, 25, 3, 10), 100)
    # 01:00 CEST 23:00Z, 02:00 CEST 00:00Z, 03:00 CET 02:00Z, 04:00 CET 03:00Z.
    assert missed == [utc(2026, 10, 24, 23), utc(2026, 10, 25, 0), utc(2026, 10, 25, 2),
                      utc(2026, 10, 25, 3)]  # fmt: skip
    assert following == utc(2026, 10, 25, 4)


def test_dst_does_not_move_an_interval():
    rule = Timing(None, 3600, BERLIN)
    assert slots(rule, utc(2026, 3, 29, 0), 3) == [utc(2026, 3, 29, h) for h in (1, 2, 3)]


def test_a_six_field_cron_has_seconds_first():
    rule = Timing("*/15 * * * * *", None, "UTC")
    assert slots(rule, utc(2026, 1, 1), 2) == [utc(2026, 1, 1, 0, 0, 15), utc(2026, 1, 1, 0, 0, 30)]


# --- definitions -------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"cron": "61 * * * *", "interval_seconds": None}, "cron"),
        ({"cron": "* * *", "interval_seconds": None}, "cron"),
        ({"cron": "0 0 30 2 *", "interval_seconds": None}, "cron"),
        ({"timezone": "Mars/Olympus"}, "timezone"),
        ({"interval_seconds": 0}, "interval_seconds"),
        ({"task": "no-such-task"}, "task"),
        ({"payload": None}, "payload"),
        ({"queue": "nope"}, "queue"),
        ({"catch_up": "some"}, "catch_up"),
    ],
    ids=["cron-range", "cron-fields", "cron-never", "zone", "interval", "task", "payload",
         "queue", "catch-up"],
)  # fmt: skip
def test_a_bad_definition_is_refused_and_writes_nothing(values, field):
    with pytest.raises(SubmissionError) as caught:
        make(**values)
    assert caught.value.field == field
    assert not Schedule.objects.exists()


@pytest.mark.django_db
def test_periodic_sync_creates_updates_and_keeps_staff_enabled():
    from jobs import tasks

    @periodic.periodic(cron="0 3 * * *", timezone=BERLIN, payload={"k": 1})
    @tasks.task("sync-probe")
    def probe(payload, ctx):
        return payload

    try:
        assert define.sync_periodic() == 1
        s = Schedule.objects.get(client=None, name="sync-probe")
        assert (s.origin, s.task, s.cron, s.timezone, s.enabled) == (
            "code", "sync-probe", "0 3 * * *", BERLIN, True
        )  # fmt: skip
        define.update(s, {"enabled": False})  # staff pause it
        periodic.DECLARED[-1]["cron"] = "0 4 * * *"  # a deploy changes the cron
        assert define.sync_periodic() == 1
        s.refresh_from_db()
        assert (s.cron, s.enabled) == ("0 4 * * *", False)
        assert define.sync_periodic() == 0
    finally:
        periodic.DECLARED[:] = [d for d in periodic.DECLARED if d["handler"] is not probe]
        tasks._registry.pop("sync-probe", None)


@pytest.mark.django_db
def test_a_deactivated_clients_schedules_wait():
    from jobs import services
    from jobs.models import Client

    client, _ = Client.create_with_token("sleepy")
    s = define.create(
        {"name": "c", "interval_seconds": 1, "task": "echo"}, client=client, origin="api"
    )
    services.deactivate_clients([client.pk])
    backdate(s, 5)
    assert Scheduler().tick().jobs == 0
    assert firing.seconds_until_next_due() is None  # not overdue: nobody should fire it
    raw("UPDATE jobs_client SET is_active = true WHERE id = %s", [client.pk])
    assert Scheduler().tick().jobs == 1


@pytest.mark.django_db(transaction=True)
def test_a_scheduler_frozen_inside_its_transaction_is_cut_off_after_five_seconds():
    """A scheduler stopped (SIGSTOP, a stalled VM) after locking a due schedule holds
    that lock only until PostgreSQL ends its idle transaction; then another fires it."""
    s = make()
    backdate(s, 0)
    locked = threading.Event()
    outcome: list = []

    def frozen() -> None:
        try:
            with transaction.atomic(durable=True):
                assert firing.lock_next_due()[0] == s.pk
                locked.set()
                threading.Event().wait(8)  # frozen, idle in transaction
                raw("SELECT 1")
            outcome.append("kept its transaction")
        except Exception as exc:  # Django's wrapper or psycopg's own, as the exit raises it
            outcome.append("cut off" if "idle-in-transaction" in str(exc) else repr(exc))
        finally:
            connections.close_all()

    t = threading.Thread(target=frozen)
    t.start()
    assert locked.wait(10)
    assert Scheduler().tick().jobs == 0  # locked: skipped, not waited for
    deadline = datetime.now(UTC) + timedelta(seconds=7)
    while Scheduler().tick().jobs == 0:
        assert datetime.now(UTC) < deadline, "still locked after 7 s"
        threading.Event().wait(0.2)
    t.join(15)
    assert outcome == ["cut off"]
    assert Job.objects.filter(schedule=s).count() == 1
