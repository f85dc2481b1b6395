"""Deliveries wait while the outbox is far behind (D409), against real Redis and
PostgreSQL: a reaper's relay a batch behind sets the flag (with a short life) and clears
it once caught up; a worker's webhooks queue stays unclaimed while it is set, for at
most JOBS_WEBHOOK_OUTBOX_HOLD seconds in a row, and a delivery's run ends early; without
Redis or with the setting at 0 nothing waits."""

from __future__ import annotations

import pytest

from harness import wait_until
from jobs import services
from jobs.events import backlog
from jobs.events.backlog import FLAG, FLAG_MS, LOOK_SECONDS, Backlog, Hold
from jobs.events.outbox import Dispatcher, dispatchers
from jobs.events.relay import FANOUT_HISTORY, WebhookFanout
from jobs.events.signing import WEBHOOK_QUEUE
from jobs.queuecontrol import Gate
from jobs.transport import NullTransport, get_transport

AFTER_A_LOOK = LOOK_SECONDS + 0.001


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def redis():
    transport = get_transport()
    assert transport.enabled
    transport.clear_flag(FLAG)
    yield transport._client
    transport.clear_flag(FLAG)


@pytest.fixture
def clock(monkeypatch, settings):
    settings.JOBS_WEBHOOK_OUTBOX_HOLD = 3.0
    found = Clock()
    monkeypatch.setattr(backlog, "HOLD", Hold(clock=found))
    return found


def key() -> str:
    return get_transport().prefix + FLAG


def test_a_relay_a_batch_behind_sets_the_flag_for_a_short_while_and_clears_it(redis):
    signal = Backlog()
    signal.report("webhooks", 1999, 2000)
    assert not redis.exists(key())
    signal.report("webhooks", 2000, 2000)
    assert 0 < redis.pttl(key()) <= FLAG_MS  # a reaper gone quiet holds nobody for long
    signal.report("stream", 0, 2000)  # one relay behind is enough
    assert redis.exists(key())
    signal.report("webhooks", 10, 2000)
    assert not redis.exists(key())


def test_a_relay_still_behind_says_so_again_before_the_flag_lapses(redis, monkeypatch):
    signal = Backlog()
    signal.report("webhooks", 5000, 2000)
    redis.delete(key())  # as if it had lapsed
    signal.report("webhooks", 5000, 2000)
    assert not redis.exists(key())  # said a moment ago: not every tick
    monkeypatch.setattr(backlog, "REFRESH_SECONDS", 0.0)
    signal.report("webhooks", 5000, 2000)
    assert redis.exists(key())


def test_a_hold_lasts_the_setting_at_most_then_as_long_open(redis, clock):
    hold = backlog.HOLD
    assert not hold.on()
    redis.set(key(), b"1")
    clock.now += AFTER_A_LOOK  # looked up at most every LOOK_SECONDS
    assert hold.on()
    clock.now += 2.9
    assert hold.on()
    clock.now += 0.2  # 3.1 s held: open now, for as long
    assert not hold.on()
    clock.now += 2.8
    assert not hold.on()
    clock.now += 0.2  # 6.1 s: held again, the backlog still there
    assert hold.on()
    redis.delete(key())
    clock.now += AFTER_A_LOOK
    assert not hold.on()
    redis.set(key(), b"1")
    clock.now += AFTER_A_LOOK
    assert hold.on()  # a new backlog: a new run of holds, from its start


def test_nothing_waits_with_the_setting_at_0_or_without_redis(redis, clock, settings, monkeypatch):
    redis.set(key(), b"1")
    settings.JOBS_WEBHOOK_OUTBOX_HOLD = 0
    assert not backlog.HOLD.on()
    settings.JOBS_WEBHOOK_OUTBOX_HOLD = 3.0
    with monkeypatch.context() as without_redis:
        without_redis.setattr(backlog, "get_transport", NullTransport)
        assert not backlog.HOLD.on()
    assert backlog.HOLD.on()  # the same flag, Redis and the setting back


def test_redis_away_holds_nobody(clock, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    assert get_transport().enabled
    assert not backlog.HOLD.on()
    Backlog().report("webhooks", 5000, 2000)  # the flag not written: no error either


@pytest.mark.django_db
def test_the_webhooks_queue_is_left_unclaimed_while_held(redis, clock):
    gate = Gate()
    assert gate.open(["default", WEBHOOK_QUEUE]) == ["default", WEBHOOK_QUEUE]
    redis.set(key(), b"1")
    clock.now += AFTER_A_LOOK
    assert gate.open(["default", WEBHOOK_QUEUE]) == ["default"]
    assert gate.wake_in() <= LOOK_SECONDS  # the worker looks again soon, not a poll later
    redis.delete(key())
    clock.now += AFTER_A_LOOK
    # Open again once the gate looks again (its own clock: LOOK_SECONDS at most).
    wait_until(lambda: gate.open([WEBHOOK_QUEUE]) == [WEBHOOK_QUEUE], 5, "the queue open again")


@pytest.mark.django_db(transaction=True)
def test_the_reapers_fan_out_and_stream_report_their_backlog_kafka_does_not(redis, settings):
    found = dispatchers()
    assert [d.backlog is not None for d in found] == [True, True]
    assert found[0].backlog is found[1].backlog
    items = [services.NewJob("echo", {"n": i}) for i in range(12)]
    services.submit_many(items)
    fanout = Dispatcher([WebhookFanout()], batch=10, sources=(FANOUT_HISTORY,),
                        backlog=Backlog())  # fmt: skip
    fanout.tick()  # its first horizon: the twelve events behind it, a batch of ten
    assert fanout.waiting >= 12
    assert redis.exists(key())
    while fanout.waiting >= 10:
        assert fanout.tick() == 10
    assert not redis.exists(key())
