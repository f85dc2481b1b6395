"""Every setting the `jobs` app reads, with its default: one line each in SETTINGS.

A host project sets only what it wants changed; app code reads through this module
(`from jobs.conf import settings`), so a setting never declared here is an error at
the first read and in tests/test_settings_owned.py, not a silent `AttributeError` at
`migrate` in someone else's project. docs/settings.md lists them (a test compares).
Names that are not the app's own (SECRET_KEY, DEBUG, ...) pass through to Django's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from django.conf import settings as django_settings


class Setting(NamedTuple):
    default: Any
    help: str
    # Turns what the project (or the environment, as text) holds into what the app reads.
    coerce: Callable[[Any], Any] | None = None


def _names(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    return list(value)


def _task_modules(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    return ["jobs.events.webhooks", *(m for m in value if m != "jobs.events.webhooks")]


_FALLBACKS: dict[str, Callable[[], Any]] = {
    # Webhook secrets are derived from this key; without one, from SECRET_KEY.
    "JOBS_WEBHOOK_KEY": lambda: django_settings.SECRET_KEY,
}

# fmt: off
SETTINGS: dict[str, Setting] = {
    "REDIS_URL": Setting("", "Redis for wake-ups, the client cache and events; empty: none (PostgreSQL polling)."),
    "JOBS_REDIS_PREFIX": Setting("jobs:", "Prefix of every Redis key the app writes."),
    "JOBS_QUEUES": Setting({"default": {}}, "Queues that accept jobs and their settings (dict or JSON text; parsed by jobs.queues)."),
    "JOBS_TASK_MODULES": Setting([], "Modules imported by runworker for their tasks (list or comma-separated).", _task_modules),
    "JOBS_PUBLIC_TASKS": Setting([], "Internal, test and example tasks clients may submit all the same, each by its exact name (list or comma-separated; D196).", _names),
    "JOBS_MAX_SCHEDULES": Setting(100, "Schedules one API client may hold (the client's own limit, set in the admin, wins)."),
    "JOBS_MAX_WEBHOOKS": Setting(10, "Webhooks one API client may hold (the client's own limit, set in the admin, wins)."),
    "JOBS_MAX_SIGNALS_PER_JOB": Setting(20, "Signals one job may hold (its client's own limit, set in the admin, wins)."),
    "JOBS_LEASE_SECONDS": Setting(15.0, "How long a claim lasts without a heartbeat."),
    "JOBS_PROGRESS_INTERVAL": Setting(1.0, "At most one progress write per running job per this many seconds."),
    "JOBS_REAPER_INTERVAL": Setting(5.0, "Seconds between the reaper's sweeps."),
    "JOBS_PARTITION_PERIOD": Setting("week", "Length of a cold partition of jobs and their history: day, week (from Monday 00:00 UTC) or month."),
    "JOBS_PARTITION_AHEAD": Setting(2, "Periods after the current one whose partitions the reaper creates ahead."),
    "JOBS_HOT_FINISHED_SECONDS": Setting(3600.0, "How long a finished job stays in the hot partition before the mover moves it to its period's."),
    "JOBS_PARTITION_MOVE_BATCH": Setting(1000, "Finished jobs the mover moves per statement."),
    "JOBS_PARTITION_LOCK_TIMEOUT": Setting(1.0, "Seconds a partition's ATTACH waits for its lock before it is left for the next sweep."),
    "JOBS_WORKER_PREFETCH": Setting(128, "Most jobs a worker holds claimed (runworker --prefetch)."),
    "JOBS_DEFAULT_TIMEOUT": Setting(3600.0, "Seconds an attempt may run when neither its job nor its task says (0: no limit)."),
    "JOBS_MAX_TIMEOUT": Setting(86400.0, "Longest timeout a job or task may ask for, in seconds."),
    "JOBS_TIMEOUT_GRACE": Setting(5.0, "Seconds between an attempt's soft stop (ctx.stop) and its hard end."),
    "JOBS_MAX_ABANDONED_THREADS": Setting(4, "Stuck handler threads a worker abandons before it restarts itself."),
    "JOBS_SCHEDULER_POLL_SECONDS": Setting(0.5, "Longest wait of the scheduler when nothing is due sooner."),
    "JOBS_SCHEDULE_CATCH_UP_MAX": Setting(100, "Most missed slots `catch_up: all` makes."),
    "JOBS_MAX_RETRIES": Setting(3, "Retry budget of a job that names none."),
    "JOBS_MAX_STEPS": Setting(1000, "Steps (checkpoints and waits) one durable job may have."),
    "JOBS_CHAIN_IDS_KEPT": Setting(100, "Earlier runs' ids a continued durable job keeps on its newest run (previous_run_ids)."),
    "JOBS_OPEN_WAIT_WARN_AGE": Setting(7 * 86400.0, "Seconds of age past which a durable job parked on a signal wait without a timeout is flagged (admin, jobs_durable_open_waits)."),
    "JOBS_WORKFLOW_MAX_EDGES": Setting(10_000, "Most `after` entries (edges) in one workflow."),
    "JOBS_MAX_QUEUE_DEPTH": Setting(100_000, "Queued jobs per queue past which submissions get 429 queue_full; past it, only jobs due within JOBS_QUEUE_DEPTH_HORIZON count (D198)."),
    "JOBS_QUEUE_DEPTH_HORIZON": Setting(60.0, "Seconds ahead a queued job counts as due for JOBS_MAX_QUEUE_DEPTH: later ones count toward their client's share only (D198)."),
    "JOBS_MAX_CLIENT_QUEUE_DEPTH": Setting(10_000, "Queued jobs, parked ones included, one API client may hold in one queue: past it that client gets 429 client_queue_full (the client's own limit, set in the admin, wins; D198)."),
    "JOBS_API_FAST_LANE": Setting(True, "The deployment's WSGI application (jobservice.wsgi) serves the plain single submission before Django's request machinery, with the same answers (jobs.api.fastlane, D185); off: every request goes through Django."),
    "JOBS_API_MAX_WAIT_SECONDS": Setting(30.0, "Longest `?wait=` a job's GET may ask for (at most 60)."),
    "JOBS_API_WAIT_SLOTS": Setting(128, "Waits one API process holds at once; past it `?wait=` answers at once (header Jobs-Wait: busy). The granian server adds as many threads."),
    "JOBS_WAIT_POLL_SECONDS": Setting(1.0, "Fallback look at the database for every waited job of a process, for ends no announcement reached."),
    "JOBS_MAX_PAYLOAD_BYTES": Setting(65_536, "Largest payload, in bytes of JSON."),
    "JOBS_RETRY_BACKOFF_BASE": Setting(1.0, "Retry backoff: base × 2^(retry-1) seconds, jittered."),
    "JOBS_RETRY_BACKOFF_MAX": Setting(60.0, "Retry backoff cap, in seconds."),
    "JOBS_LOST_SIGNAL_SECONDS": Setting(10.0, "A due queued job untouched this long is signalled again."),
    "JOBS_SLO_SECONDS": Setting(25.0, "The latency SLO: due to finished."),
    "JOBS_PRESENCE_SECONDS": Setting(1.0, "How often each worker beats its jobs_worker row."),
    "JOBS_SESSION_CRASH_DETECTION": Setting(True, "Requeue a dead worker's jobs by its PostgreSQL session (behind a transaction-mode pooler, with JOBS_DIRECT_DATABASE_URL)."),
    "JOBS_REPLICA_MAX_LAG_SECONDS": Setting(5.0, "Past this replica lag, reads meant for the replica go to the primary (and a client that wrote reads its listings from the primary this long)."),
    "JOBS_REPLICA_LAG_CHECK_SECONDS": Setting(1.0, "How often each process measures the replica's lag."),
    "JOBS_DIRECT_DATABASE_URL": Setting("", "PostgreSQL itself (not a pooler) for the worker's presence session, which holds its crash-detection lock; empty: the default database."),
    "JOBS_METRICS_CACHE_SECONDS": Setting(5.0, "How long depth/age readings are reused across scrapes."),
    "JOBS_METRICS_HOST": Setting("127.0.0.1", "Where runworker/runreaper --metrics-port listen."),
    "JOBS_CLIENT_CACHE_SECONDS": Setting(10.0, "How long API clients are cached by token (0: off)."),
    "JOBS_OUTBOX_INTERVAL": Setting(0.5, "Seconds between the completion-event dispatcher's polls."),
    "JOBS_EVENTS_STREAM_MAXLEN": Setting(100_000, "Approximate length of the Redis events stream."),
    "JOBS_KAFKA_BOOTSTRAP_SERVERS": Setting("", "Kafka brokers of the completion-event sink (the `kafka` extra); empty: the sink is off."),
    "JOBS_KAFKA_TOPIC": Setting("jobs.events", "Topic the sink produces every outbox event to."),
    "JOBS_KAFKA_CONFIG": Setting("", "librdkafka producer settings: a dict or JSON object (security, compression, linger)."),
    "JOBS_KAFKA_ACK_TIMEOUT": Setting(5.0, "Seconds the sink waits for the broker's acknowledgements."),
    "JOBS_WEBHOOK_ALLOW_PRIVATE": Setting(False, "Let webhooks reach loopback and private addresses (development)."),
    "JOBS_WEBHOOK_CONNECT_TIMEOUT": Setting(3.0, "Webhook delivery connect timeout, seconds."),
    "JOBS_WEBHOOK_READ_TIMEOUT": Setting(10.0, "Webhook delivery read timeout, seconds."),
    "JOBS_WEBHOOK_TIMEOUT": Setting(13.0, "Total seconds of one delivery attempt: connect, send and the whole answer."),
    "JOBS_WEBHOOK_CONCURRENCY": Setting(4, "Threads runworker gives webhook deliveries, apart from jobs' (--webhook-concurrency)."),
    "JOBS_WEBHOOK_ENDPOINT_CONCURRENCY": Setting(2, "Delivery attempts calling one endpoint at once (0: no bound)."),
    "JOBS_WEBHOOK_CIRCUIT_FAILURES": Setting(5, "Failed attempts in a row that open an endpoint's circuit (0: no breaker)."),
    "JOBS_WEBHOOK_CIRCUIT_OPEN_SECONDS": Setting(10.0, "First open period of a circuit, doubling each time it opens again."),
    "JOBS_WEBHOOK_CIRCUIT_MAX_OPEN_SECONDS": Setting(600.0, "Longest open period of a circuit."),
    "JOBS_WEBHOOK_MAX_RESPONSE_BYTES": Setting(4096, "Bytes of a receiver's answer kept."),
    "JOBS_WEBHOOK_MAX_RETRIES": Setting(10, "Retry budget of a webhook delivery."),
    "JOBS_WEBHOOK_OUTBOX_HOLD": Setting(3.0, "Longest wait in a row of webhook deliveries while the outbox relays are a batch behind, then as long open (0: never wait)."),
    "JOBS_WEBHOOK_CA_BUNDLE": Setting("", "PEM file of CA certificates for https receivers; empty: the system's."),
    "JOBS_WEBHOOK_KEY": Setting("", "Key webhook secrets are derived from; empty: SECRET_KEY."),
    "JOBS_ARCHIVE_DIR": Setting("", "Local directory prunejobs archives expired partitions to (Parquet, the `archive` extra); empty: they are kept, not archived."),
    "PRODUCTION": Setting(False, "Production rules apply (webhooks must be https); jobservice reads JOBS_PRODUCTION."),
    "LOG_FORMAT": Setting("text", "`json` or `text`: how runworker/runreaper print their banners."),
}
# fmt: on

# Settings of the app whose names carry no JOBS_ prefix: a test also looks for these.
UNPREFIXED = frozenset(name for name in SETTINGS if not name.startswith("JOBS_"))


class JobsSettings:
    """The project's value of each declared setting, else its default. Read at each
    access (tests change settings in every way); a coerced value is reused while the
    project's value is the same object."""

    def __init__(self) -> None:
        self._coerced: dict[str, tuple[Any, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        declared = SETTINGS.get(name)
        if declared is None:
            if name.startswith("JOBS_"):
                raise AttributeError(f"{name} is not a jobs setting: declare it in jobs/conf.py")
            return getattr(django_settings, name)  # Django's own (SECRET_KEY, DEBUG, ...)
        value = getattr(django_settings, name, declared.default)
        if not value and name in _FALLBACKS:
            return _FALLBACKS[name]()
        if declared.coerce is None:
            return value
        raw, coerced = self._coerced.get(name, (None, None))
        if raw is not value:
            coerced = declared.coerce(value)
            self._coerced[name] = (value, coerced)
        return coerced


settings = JobsSettings()


def from_environment(env: Any, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Each declared setting the environment sets (django-environ `env`), read as its
    default's type: a deployment's settings.py gets every setting in one line."""
    readers = {bool: env.bool, int: env.int, float: env.float, list: env.list, dict: env.str}
    found = {}
    for name, declared in SETTINGS.items():
        if name in skip or env.str(name, default="") == "":
            continue
        found[name] = readers.get(type(declared.default), env.str)(name)
    return found
