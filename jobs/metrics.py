"""Prometheus metrics (SPEC §7). Labels are queue, task, outcome and small
enums only — never job ids, so cardinality stays bounded.

Counters and histograms live here and are counted where the event happens,
once per event, in whichever process made it happen (API, worker, reaper,
staff action). Gauges do not: they belong to one kind of process and are
computed at scrape time by the collectors in `jobs.collectors`, registered by
that process only (depth by the reaper, slots by each worker). The API runs
these objects under gunicorn's multiprocess mode, so a Gauge added here would
need a `multiprocess_mode` (see gunicorn.conf.py).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Histogram

from jobs.conf import settings

# Fine around the 25 s SLO so that histogram_quantile and the le="25" bucket are exact
# there; a configured JOBS_SLO_SECONDS gets a bucket of its own.
SLO_BUCKETS = tuple(
    sorted(
        {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 20, 22.5, 25, 27.5, 30, 45, 60, 120, 300}
        | {600, float(settings.JOBS_SLO_SECONDS)}
    )
)
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

SUBMITTED = Counter("jobs_submitted_total", "Jobs accepted", ["queue", "task"])
SUBMISSIONS_REJECTED = Counter(
    "jobs_submissions_rejected_total",
    "Submissions refused before anything was written, by error code (queue_full = backpressure)",
    ["queue", "code"],
)
CLAIMED = Counter("jobs_claimed_total", "Jobs claimed by a worker", ["queue"])
FINISHED = Counter(
    "jobs_finished_total", "Jobs that reached a terminal state", ["queue", "task", "outcome"]
)
DURATION = Histogram(
    "jobs_duration_seconds",
    "Handler run time of one attempt",
    ["queue", "task"],
    buckets=DURATION_BUCKETS,
)
TIME_TO_TERMINAL = Histogram(
    "jobs_time_to_terminal_seconds",
    "Due (submission, or run_at if later) to terminal state, failures included (the 25 s SLO)",
    ["queue", "task", "outcome"],
    buckets=SLO_BUCKETS,
)
RETRIES = Histogram(
    "jobs_retries",
    "retry_count of jobs when they reached a terminal state",
    ["queue", "task", "outcome"],
    buckets=(0, 1, 2, 3, 4, 5, 10, 20),
)
ATTEMPTS_ENDED_BY_WATCHDOG = Counter(
    "jobs_attempts_ended_by_watchdog_total",
    "Attempts the worker ended itself: past timeout + grace (timeout) or whose handler "
    "thread ended without a result (lost_handler)",
    ["queue", "task", "reason"],
)
ABANDONED_THREADS = Counter(
    "jobs_abandoned_threads_total",
    "Handler threads left running a timed-out handler (a new thread took the slot)",
    ["queue", "task"],
)
# The process pool (jobs.worker.pools.processes).
POOL_CHILDREN_REPLACED = Counter(
    "jobs_pool_children_replaced_total",
    "Process-pool children replaced: died under an attempt or between attempts, killed at "
    "timeout + grace, or recycled (max_tasks, max_memory)",
    ["reason"],
)
POOL_CHILD_STARTS = Histogram(
    "jobs_pool_child_start_seconds",
    "Time to fork a process-pool child",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
RETRIED = Counter("jobs_retried_total", "Failed attempts sent back to queued", ["queue", "task"])
LEASE_EXPIRED = Counter("jobs_lease_expired_total", "Leases found expired by the reaper", ["queue"])
REAPER_SWEEPS = Counter("jobs_reaper_sweeps_total", "Reaper sweeps completed")
PARTITION_MOVED = Counter(
    "jobs_partition_moved_total", "Finished jobs moved from the hot partition to their cold one"
)
# Schedules (jobs.schedules): from a slot's fire time to the commit of its job. No
# label: schedule names and ids are unbounded.
SCHEDULE_LAG = Histogram(
    "jobs_schedule_lag_seconds",
    "Seconds from a schedule slot's fire time to the scheduler claiming it",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 3600),
)
WEBHOOK_DELIVERIES_HELD = Counter(
    "jobs_webhook_deliveries_held_total",
    "Webhook deliveries kept waiting because the webhooks queue was past "
    "JOBS_MAX_QUEUE_DEPTH (each is released when the queue has room)",
)
WEBHOOK_OUTBOX_HOLDS = Counter(
    "jobs_webhook_outbox_holds_total",
    "Times a worker's webhook deliveries began waiting for the outbox relays to catch up "
    "(JOBS_WEBHOOK_OUTBOX_HOLD)",
)
SCHEDULE_SLOTS = Counter(
    "jobs_schedule_slots_total",
    "Schedule slots claimed by this scheduler, by outcome (enqueued, overlap_skipped, queue_full)",
    ["outcome"],
)
REAPER_SWEEP_DURATION = Histogram(
    "jobs_reaper_sweep_duration_seconds", "Reaper sweep wall time", buckets=DURATION_BUCKETS
)
RECOVERED = Counter(
    "jobs_recovered_total",
    "Jobs repaired by the reaper, by kind "
    "(lease, enqueue_failed, lost_signal, scheduled, over_budget)",
    ["kind"],
)
FENCE_REJECTIONS = Counter(
    "jobs_fence_rejections_total", "Stale writes rejected by the fence", ["queue", "task", "op"]
)
ATTEMPTS_DROPPED = Counter(
    "jobs_attempts_dropped_total",
    "Prefetched attempts dropped before their handler was called: the lease was "
    "revoked or the job cancelled while it waited",
    ["queue", "reason"],
)
WRITEBACK_REFUSED = Counter(
    "jobs_writeback_refused_total",
    "Rows of a worker's batched write-back that PostgreSQL refused (a data error), "
    "written apart so that only their own job fails",
    ["queue", "task", "op"],
)
ENQUEUE_FAILED = Counter(
    "jobs_enqueue_failed_total", "Jobs parked as enqueue_failed after a failed push", ["queue"]
)
DUPLICATE_DELIVERIES = Counter(
    "jobs_duplicate_deliveries_total", "Signals for jobs no longer claimable", ["queue"]
)
REDIS_ERRORS = Counter("jobs_redis_errors_total", "Redis commands that failed", ["op"])
HEARTBEATS = Counter("jobs_heartbeats_total", "Leases extended by a heartbeat", ["queue"])
DB_ERRORS = Counter(
    "jobs_db_errors_total", "Database operations that failed and were retried", ["op"]
)
STAFF_ACTIONS = Counter(
    "jobs_staff_actions_total",
    "Jobs changed by a staff action (retry, repair, revoke, cancel)",
    ["action"],
)
# Durable jobs and workflows (jobs.durable, jobs.workflows). The number of jobs parked
# now, by reason, is a gauge of the scrape (jobs.collectors).
PARKED = Counter(
    "jobs_parked_total", "Attempts that parked their job (sleep, signal wait)", ["reason"]
)
SIGNALS = Counter("jobs_signals_total", "Signals delivered to jobs")
STEPS_PER_JOB = Histogram(
    "jobs_steps_per_job",
    "Steps (checkpoints and waits) a durable job had when it ended or parked",
    ["task"],
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
)
CONTINUED = Counter(
    "jobs_durable_continued_total", "Durable runs that continued as new (their next run started)"
)
HISTORY_STEPS = Histogram(
    "jobs_durable_history_steps",
    "Stored history rows (steps and waits) of a durable run when an attempt ended or parked",
    ["task"],
    buckets=(10, 50, 100, 250, 500, 750, 900, 1000),
)
NONDETERMINISTIC = Counter(
    "jobs_durable_nondeterministic_total",
    "Replays whose code asked for other steps than the history holds",
    ["task"],
)
WORKFLOW_SECONDS = Histogram(
    "jobs_workflow_completion_seconds",
    "Workflow creation to its last job's end (observed by the process that ended it)",
    buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 6 * 3600, 24 * 3600),
)


_children: dict[tuple[Any, ...], Any] = {}


def child(metric: Any, *labels: str) -> Any:
    """`metric.labels(*labels)`, cached: the hot path skips labels()' lock and checks.

    Label values are queue/task/outcome names, so the cache stays as small as the
    metric's own set of children.
    """
    key = (metric, *labels)
    found = _children.get(key)
    if found is None:
        found = _children[key] = metric.labels(*labels)
    return found


def observe_terminal(
    queue: str,
    task: str,
    outcome: str,
    time_to_terminal: float | None,
    retry_count: int,
) -> None:
    """Record one job reaching done/failed, whoever moved it there."""
    child(FINISHED, queue, task, outcome).inc()
    child(RETRIES, queue, task, outcome).observe(retry_count)
    if time_to_terminal is not None:
        child(TIME_TO_TERMINAL, queue, task, outcome).observe(max(time_to_terminal, 0.0))


# Completion events (jobs.events): counted by the dispatcher and the delivery task.
EVENTS_DISPATCHED = Counter(
    "jobs_events_dispatched_total",
    "Outbox events handed to a subscriber (webhooks, stream, kafka), committed with its cursor",
    ["subscriber"],
)
# The Kafka sink of the outbox (jobs/events/kafka.py), counted in runreaper.
KAFKA_PRODUCED = Counter(
    "jobs_kafka_produced_total",
    "Outbox events the Kafka broker acknowledged (repeats after a failure count again)",
)
KAFKA_ERRORS = Counter(
    "jobs_kafka_errors_total",
    "Kafka sink errors by librdkafka reason (or not_acknowledged: a batch timed out)",
    ["reason"],
)
WEBHOOK_DELIVERIES = Counter(
    "jobs_webhook_deliveries_total",
    "Webhook delivery attempts by outcome (delivered, http_error, timeout, error, gone, "
    "refused, disabled, dropped; deferred: parked without a call, circuit open or the "
    "endpoint's slots busy)",
    ["outcome"],
)
WEBHOOK_CIRCUIT = Counter(
    "jobs_webhook_circuit_changes_total",
    "Webhook endpoints' circuit breakers changing state (open, half_open: a probe went "
    "out, closed, reopened: a probe or a late attempt failed)",
    ["to"],
)
WEBHOOK_LAG = Histogram(
    "jobs_webhook_delivery_lag_seconds",
    "From the event's commit-time stamp to its successful delivery",
    buckets=SLO_BUCKETS,
)
