"""The tests' view of the shared harness (`harness/`): real processes, a private Redis.

Nothing here fakes a service. Kept so tests import one module; the code lives in
`harness`, shared with the fault suite and the benchmark.
"""

from __future__ import annotations

from pathlib import Path

from harness import (
    ROOT,
    KafkaBroker,
    Processes,
    RedisServer,
    Service,
    database_url,
    free_port,
    interrupt_detach,
    service_env,
    wait_until,
)

Proc = Service

__all__ = [
    "ROOT",
    "KafkaBroker",
    "Proc",
    "RedisServer",
    "Stack",
    "database_url",
    "free_port",
    "interrupt_detach",
    "wait_until",
]


class Stack(Processes):
    """Workers and reapers against the test database and a Redis URL."""

    def __init__(
        self, tmp_path: Path, redis_url: str = "", prefix: str = "e2e:", **env: str
    ) -> None:
        super().__init__(
            tmp_path, service_env(database_url(), redis_url, prefix, "demo.tasks", **env)
        )
        self.tmp = tmp_path
