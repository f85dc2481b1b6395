"""Real processes for the tests, the fault suite (`chaos/`) and the benchmark (`bench/`).

Dev tooling, not product code: nothing under `jobs/` imports it. One place for starting,
signalling and killing services, a private redis-server, scratch databases and the
polling helpers, so the three users cannot drift apart.
"""

from harness.detach import interrupt_detach
from harness.kafka_broker import KafkaBroker
from harness.pgbouncer import PgBouncer
from harness.procs import (
    ROOT,
    Processes,
    Service,
    WaitTimeout,
    api_server,
    free_port,
    gunicorn,
    http_ok,
    manage,
    service_env,
    wait_until,
)
from harness.redis_server import RedisServer
from harness.scratch import DEFAULT_ADMIN_URL, ScratchDatabase, checkout_tag, database_url

__all__ = [
    "DEFAULT_ADMIN_URL",
    "KafkaBroker",
    "PgBouncer",
    "ROOT",
    "Processes",
    "RedisServer",
    "ScratchDatabase",
    "Service",
    "WaitTimeout",
    "checkout_tag",
    "database_url",
    "free_port",
    "api_server",
    "gunicorn",
    "http_ok",
    "interrupt_detach",
    "manage",
    "service_env",
    "wait_until",
]
