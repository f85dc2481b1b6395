"""Gauges computed at scrape time, each exported by the one process that owns it.

- `DepthCollector`: jobs_depth and jobs_oldest_age_seconds by state and queue,
  from ONE grouped query cached for a few seconds; registered by the reaper only,
  so the database answers it once per cache period however many processes and
  scrapers there are.
- `ConsumersCollector`: jobs_queue_consumers and jobs_unserved_queue_depth (queued
  jobs on a queue no live worker serves), from the worker registry; reaper only.
- `QueueControlsCollector`: each queue's controls and what they hold back (paused,
  processing against the cap, rate tokens left); reaper only.
- `WebhookCircuitsCollector`: jobs_webhook_circuits, enabled endpoints by breaker
  state, one small grouped query per cache period; reaper only.
- `WaitingCollector`: jobs_waiting by reason (parked durable jobs, blocked workflow
  jobs), from the partial index job_waiting_idx, cached like the depth; reaper only.
- `DurableHistoryCollector`: the largest live durable history (rows, bytes), its limit
  and the old signal waits without a timeout, one statement per cache period; reaper only.
- `PartitionCollector`: the hot partition's rows, the mover's lag, the history
  partitions' runway and detaches left pending, one small query per cache period;
  reaper only.
- `worker_gauges`: jobs_worker_inflight and jobs_worker_slots of one worker.
- `reaper_gauges`: when the reaper last finished a sweep, and its cadence.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import DatabaseError, InterfaceError, connection
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from jobs import gauges, metrics, replica, selectors
from jobs.conf import settings
from jobs.lifecycle import NON_TERMINAL, Status, WaitReason

if TYPE_CHECKING:
    from jobs.reaper import Reaper
    from jobs.schedules.scheduler import Scheduler
    from jobs.worker import Worker

log = logging.getLogger(__name__)

# A queue that emptied keeps reporting zeros this long, so dashboards show 0, not a gap.
FORGET_QUEUE_AFTER = 3600.0

DEPTH_HELP = "Jobs in a non-terminal state, by queue (queued includes scheduled and backed-off)"
CONSUMERS_HELP = "Live worker processes serving the queue (workers serving '*' included)"
UNSERVED_HELP = "Queued jobs on a queue that no live worker serves: they wait forever"
AGE_HELP = (
    "Age of the oldest job in the state: queued since due, processing since claimed, "
    "enqueue_failed since parked"
)


T = TypeVar("T")


def read_on_scrape_thread(what: str, read: Callable[[], T]) -> T | None:
    """One read for a scrape: None (counted, logged) when PostgreSQL fails.

    Scrapes run on short-lived server threads: their connection is closed after the
    read, not left behind (a test's own transaction is left alone).
    """
    try:
        with replica.reads():  # scrapes tolerate the replica's lag (D147)
            return read()
    except (DatabaseError, InterfaceError) as exc:
        metrics.DB_ERRORS.labels(op="depth").inc()
        log.warning("%s unavailable, postgres failed: %s", what, exc)
        return None
    finally:
        replica.close_read_connection()
        if not connection.in_atomic_block:
            connection.close()


class ScrapeCache:
    """One read per `seconds` for a collector, under a lock, whatever the number of
    scrapers; a failed read gives None (counted, logged) and is tried at the next scrape."""

    def __init__(
        self, what: str, read: Callable[[], Any], seconds: float, clock: Callable[[], float]
    ) -> None:
        self.what, self.read, self.seconds, self.clock = what, read, seconds, clock
        self._lock = threading.Lock()
        self._value: Any = None
        self._at = float("-inf")

    def get(self) -> Any:
        with self._lock:
            now = self.clock()
            if self._value is None or now - self._at >= self.seconds:
                self._value = read_on_scrape_thread(self.what, self.read)
                self._at = now
            return self._value


class DepthCollector(Collector):
    """Depth and oldest age per (state, queue), read with one cached grouped query.

    A failed read is counted in jobs_db_errors_total{op="depth"} and leaves the
    gauges out of that scrape (a stale depth would lie); the rest of the process's
    metrics are still served.
    """

    def __init__(
        self,
        cache_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache_seconds = (
            settings.JOBS_METRICS_CACHE_SECONDS if cache_seconds is None else cache_seconds
        )
        self.clock = clock
        self.reads = 0  # database round trips, for tests and curiosity
        self._lock = threading.Lock()
        self._rows: list[tuple[str, str, int, float]] | None = None
        self._read_at = float("-inf")
        self._seen: dict[str, float] = {}

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("jobs_depth", DEPTH_HELP, labels=["state", "queue"])
        yield GaugeMetricFamily("jobs_oldest_age_seconds", AGE_HELP, labels=["state", "queue"])

    def _read(self) -> list[tuple[str, str, int, float]] | None:
        with self._lock:
            now = self.clock()
            if self._rows is not None and now - self._read_at < self.cache_seconds:
                return self._rows
            rows = self._rows = read_on_scrape_thread("queue depth", gauges.depth_by_state)
            if rows is None:
                return None
            self.reads += 1
            self._rows, self._read_at = rows, now
            for _, queue, _, _ in rows:
                self._seen[queue] = now
            for queue, seen in list(self._seen.items()):
                if now - seen > FORGET_QUEUE_AFTER:
                    del self._seen[queue]
            return rows

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rows = self._read()
        if rows is None:
            return
        found = {(state, queue): (count, age) for state, queue, count, age in rows}
        depth = GaugeMetricFamily("jobs_depth", DEPTH_HELP, labels=["state", "queue"])
        age = GaugeMetricFamily("jobs_oldest_age_seconds", AGE_HELP, labels=["state", "queue"])
        for queue in sorted(self._seen):
            for state in NON_TERMINAL:
                count, oldest = found.get((state, queue), (0, 0.0))
                depth.add_metric([state.value, queue], count)
                age.add_metric([state.value, queue], oldest)
        yield depth
        yield age


class ConsumersCollector(Collector):
    """jobs_queue_consumers and jobs_unserved_queue_depth: the worker registry read
    against the depth the reaper's DepthCollector holds (its cached rows, its queues),
    with one small query of the registry per cache period."""

    def __init__(self, depth: DepthCollector) -> None:
        self.depth = depth
        self._consumers = ScrapeCache(
            "queue consumers", selectors.queue_consumers, depth.cache_seconds, depth.clock
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("jobs_queue_consumers", CONSUMERS_HELP, labels=["queue"])
        yield GaugeMetricFamily("jobs_unserved_queue_depth", UNSERVED_HELP, labels=["queue"])

    def _read(self) -> Callable[[str], int] | None:
        return self._consumers.get()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rows = self.depth._read()
        consumers_of = self._read()
        if rows is None or consumers_of is None:
            return
        queued = {queue: count for state, queue, count, _ in rows if state == Status.QUEUED}
        consumers = GaugeMetricFamily("jobs_queue_consumers", CONSUMERS_HELP, labels=["queue"])
        unserved = GaugeMetricFamily("jobs_unserved_queue_depth", UNSERVED_HELP, labels=["queue"])
        for queue in sorted(self.depth._seen):
            serving = consumers_of(queue)
            consumers.add_metric([queue], serving)
            unserved.add_metric([queue], 0 if serving else queued.get(queue, 0))
        yield consumers
        yield unserved


QUEUE_GAUGES = {
    "jobs_queue_paused": "1 while the queue is paused: its jobs wait queued, none starts",
    "jobs_queue_concurrency_limit": "The queue's cap on jobs processing at once (capped queues)",
    "jobs_queue_concurrency_used": "Jobs of a capped queue processing now, against its cap",
    "jobs_queue_rate_limit": "Job starts the queue's rate allows per period (rate-limited queues)",
    "jobs_queue_rate_tokens": "Starts the queue's rate still allows in the current window",
}


class QueueControlsCollector(Collector):
    """The queue controls (jobs_queue rows) with one small query per cache period."""

    def __init__(self, cache_seconds: float | None = None) -> None:
        seconds = settings.JOBS_METRICS_CACHE_SECONDS if cache_seconds is None else cache_seconds
        self._states = ScrapeCache("queue controls", gauges.queue_states, seconds, time.monotonic)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        for name, documentation in QUEUE_GAUGES.items():
            yield GaugeMetricFamily(name, documentation, labels=["queue"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        states = self._states.get()
        if states is None:
            return
        families = {
            name: GaugeMetricFamily(name, documentation, labels=["queue"])
            for name, documentation in QUEUE_GAUGES.items()
        }
        for q in states:
            families["jobs_queue_paused"].add_metric([q.name], int(q.paused))
            if q.concurrency is not None:
                families["jobs_queue_concurrency_limit"].add_metric([q.name], q.concurrency)
                families["jobs_queue_concurrency_used"].add_metric([q.name], q.processing)
            if q.rate_limit is not None:
                families["jobs_queue_rate_limit"].add_metric([q.name], q.rate_limit)
                families["jobs_queue_rate_tokens"].add_metric([q.name], q.rate_tokens)
        yield from families.values()


CIRCUITS_HELP = (
    "Enabled webhook endpoints by circuit breaker state (open: deliveries park without a "
    "call; half_open: one probe is out)"
)


class WebhookCircuitsCollector(Collector):
    """jobs_webhook_circuits{state}: how many receivers are being backed off now (the
    change counter says when they opened; this says whether they still are)."""

    def __init__(self, cache_seconds: float | None = None) -> None:
        seconds = settings.JOBS_METRICS_CACHE_SECONDS if cache_seconds is None else cache_seconds
        self._counts = ScrapeCache(
            "webhook circuits", gauges.webhook_circuit_counts, seconds, time.monotonic
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("jobs_webhook_circuits", CIRCUITS_HELP, labels=["state"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = self._counts.get()
        if counts is None:
            return
        gauge = GaugeMetricFamily("jobs_webhook_circuits", CIRCUITS_HELP, labels=["state"])
        for state, n in sorted(counts.items()):
            gauge.add_metric([state], n)
        yield gauge


WAITING_HELP = (
    "Queued jobs that are not due because they wait: sleep and signal (parked by their "
    "handler), parents (workflow jobs whose parents have not ended)"
)


class WaitingCollector(Collector):
    """jobs_waiting{reason}: one small grouped query per cache period."""

    def __init__(self, depth: DepthCollector) -> None:
        self._counts = ScrapeCache(
            "waiting jobs", gauges.waiting_by_reason, depth.cache_seconds, depth.clock
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("jobs_waiting", WAITING_HELP, labels=["reason"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = self._counts.get()
        if counts is None:
            return
        gauge = GaugeMetricFamily("jobs_waiting", WAITING_HELP, labels=["reason"])
        for reason in WaitReason.values:
            gauge.add_metric([reason], counts.get(reason, 0))
        yield gauge


HISTORY_STEPS_MAX_HELP = (
    "History rows (steps and waits) of the live durable run that has the most; a run "
    "fails at JOBS_MAX_STEPS (jobs_durable_history_limit): continue it as new"
)
HISTORY_BYTES_MAX_HELP = "Stored result bytes of the live durable run that has the most"
HISTORY_LIMIT_HELP = "JOBS_MAX_STEPS: the history rows one durable run may have"
OPEN_WAITS_HELP = (
    "Durable jobs parked on a signal wait without a timeout, created longer than "
    "JOBS_OPEN_WAIT_WARN_AGE ago (prefer timers: a timeout and a loop)"
)


class DurableHistoryCollector(Collector):
    """The largest live durable history (rows and bytes) against its limit, and the old
    open waits: one statement per cache period (D319); reaper only."""

    def __init__(self, cache_seconds: float | None = None) -> None:
        seconds = settings.JOBS_METRICS_CACHE_SECONDS if cache_seconds is None else cache_seconds
        self._state = ScrapeCache(
            "durable history", gauges.durable_history_state, seconds, time.monotonic
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("jobs_durable_history_steps_max", HISTORY_STEPS_MAX_HELP)
        yield GaugeMetricFamily("jobs_durable_history_bytes_max", HISTORY_BYTES_MAX_HELP)
        yield GaugeMetricFamily("jobs_durable_history_limit", HISTORY_LIMIT_HELP)
        yield GaugeMetricFamily("jobs_durable_open_waits", OPEN_WAITS_HELP)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._state.get()
        if state is None:
            return
        steps, size, open_waits = state
        yield GaugeMetricFamily("jobs_durable_history_steps_max", HISTORY_STEPS_MAX_HELP, steps)
        yield GaugeMetricFamily("jobs_durable_history_bytes_max", HISTORY_BYTES_MAX_HELP, size)
        limit = float(settings.JOBS_MAX_STEPS)
        yield GaugeMetricFamily("jobs_durable_history_limit", HISTORY_LIMIT_HELP, limit)
        yield GaugeMetricFamily("jobs_durable_open_waits", OPEN_WAITS_HELP, open_waits)


HOT_ROWS_HELP = (
    "Rows in jobs_job_hot: live jobs and those finished within JOBS_HOT_FINISHED_SECONDS "
    "(the planner's estimate from the last ANALYZE)"
)
MOVE_LAG_HELP = (
    "How long the oldest finished job in jobs_job_hot has waited past "
    "JOBS_HOT_FINISHED_SECONDS for the mover (0: none is late)"
)
RUNWAY_HELP = (
    "Seconds until the end of the newest history partition: past it no job can be "
    "written; the reaper creates partitions ahead"
)

DETACH_PENDING_HELP = (
    "Partitions of jobs_job and jobs_jobevent an interrupted DETACH ... CONCURRENTLY left "
    "pending: their period's rows can be neither written nor read; the reaper attaches "
    "them again"
)


class PartitionCollector(Collector):
    """The partitioned tables' health: the hot partition's size, the mover's lag, the
    partitions' runway and detaches left pending, one small query per cache period
    (D191, D214)."""

    def __init__(self, cache_seconds: float | None = None) -> None:
        seconds = settings.JOBS_METRICS_CACHE_SECONDS if cache_seconds is None else cache_seconds
        self._state = ScrapeCache("partitions", gauges.partition_state, seconds, time.monotonic)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("jobs_hot_partition_rows", HOT_ROWS_HELP)
        yield GaugeMetricFamily("jobs_partition_move_lag_seconds", MOVE_LAG_HELP)
        yield GaugeMetricFamily("jobs_partition_runway_seconds", RUNWAY_HELP)
        yield GaugeMetricFamily("jobs_partition_detach_pending", DETACH_PENDING_HELP)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._state.get()
        if state is None:
            return
        if state.hot_rows is not None:
            yield GaugeMetricFamily("jobs_hot_partition_rows", HOT_ROWS_HELP, state.hot_rows)
        late = (state.oldest_hot_finished_age or 0.0) - settings.JOBS_HOT_FINISHED_SECONDS
        yield GaugeMetricFamily("jobs_partition_move_lag_seconds", MOVE_LAG_HELP, max(0.0, late))
        if state.runway is not None:
            yield GaugeMetricFamily("jobs_partition_runway_seconds", RUNWAY_HELP, state.runway)
        yield GaugeMetricFamily(
            "jobs_partition_detach_pending", DETACH_PENDING_HELP, state.detach_pending
        )


class LiveGauges(Collector):
    """Gauges read from one live object at each scrape: (name, help, read)."""

    def __init__(self, gauges: list[tuple[str, str, Callable[[], float]]]) -> None:
        self.gauges = gauges

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, documentation, read in self.gauges:
            yield GaugeMetricFamily(name, documentation, value=read())


def worker_gauges(worker: Worker) -> LiveGauges:
    """One worker's busy and total slots: capacity, and its presence to Prometheus."""
    return LiveGauges([
        ("jobs_worker_inflight",
         "Jobs this worker is running right now (busy slots; results awaiting "
         "write-back no longer take a slot)", lambda: worker.running),
        ("jobs_worker_slots", "Jobs this worker can hold at once (--concurrency)",
         lambda: worker.concurrency),
    ])  # fmt: skip


def reaper_gauges(reaper: Reaper) -> LiveGauges:
    """When the last sweep finished: a reaper that is up but stuck shows here."""
    return LiveGauges([
        ("jobs_reaper_last_sweep_timestamp_seconds",
         "Unix time the last sweep finished (0: none yet)", lambda: reaper.last_sweep_at),
        ("jobs_reaper_interval_seconds", "Seconds between sweeps", lambda: reaper.interval),
    ])  # fmt: skip


def replica_gauges() -> LiveGauges:
    """The replica's lag as the routing sees it (NaN: not streaming, so not used)."""

    def read() -> float:
        seconds = replica.lag.measure()
        replica.close_read_connection()
        return math.nan if seconds is None else seconds

    return LiveGauges([
        ("jobs_replica_lag_seconds",
         "Seconds the read replica is behind the primary (0: replayed all it received; "
         "NaN: not streaming). Past JOBS_REPLICA_MAX_LAG_SECONDS reads go to the primary",
         read),
    ])  # fmt: skip


def scheduler_gauges(scheduler: Scheduler) -> LiveGauges:
    """A reaper's scheduler that stopped ticking, and schedules that stopped firing."""
    return LiveGauges([
        ("jobs_scheduler_last_tick_timestamp_seconds",
         "Unix time this reaper's scheduler last read the schedules (0: not yet)",
         lambda: scheduler.last_tick_at),
        ("jobs_schedule_overdue_seconds",
         "How far the most overdue enabled schedule's next slot lay behind the database "
         "clock at the last tick (0: none overdue)", lambda: scheduler.overdue),
    ])  # fmt: skip
