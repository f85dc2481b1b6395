"""What the long-running processes (runworker, runreaper) share: stop signals, backoff,
the metrics HTTP server and its command-line options.

Stopping follows rq: the first SIGTERM/SIGINT asks for a warm stop (finish, then exit);
the second raises `ColdStop` in the main thread, so `finally` blocks still run
(connections closed, presence unregistered) instead of `os._exit` skipping them.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from django.core.checks import Tags
from django.core.management.base import CommandError

from jobs.conf import settings

# The system checks a process that serves no page runs before it starts (D137): the URL
# and template checks import the URLconf (the API, its schema, the admin) and compile
# every template, a third of a worker's start-up, for pages it never serves.
HEADLESS_CHECKS = [
    Tags.async_support,
    Tags.caches,
    Tags.compatibility,
    Tags.database,
    Tags.models,
    Tags.signals,
    Tags.translation,
]

COLD_STOP_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for an interrupted process


class ColdStop(SystemExit):
    """Raised by the second stop request: leave now, leases held are the reaper's."""

    def __init__(self) -> None:
        super().__init__(COLD_STOP_EXIT_CODE)


class StopRequests:
    """Counts stop requests: the first calls `warm`, the second (and later) `cold`, then
    raises ColdStop. Signal handlers run on the main thread, so that is where it lands."""

    def __init__(self, warm: Callable[[], None], cold: Callable[[], None] | None = None):
        self._warm = warm
        self._cold = cold
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self._count

    @property
    def cold(self) -> bool:
        return self._count > 1

    def request(self) -> None:
        with self._lock:
            self._count += 1
            first = self._count == 1
        if first:
            self._warm()
            return
        if self._cold is not None:
            self._cold()
        raise ColdStop

    def install(self, signals=(signal.SIGTERM, signal.SIGINT)) -> None:
        """Route `signals` here (main thread only, as Python requires)."""
        for sig in signals:
            signal.signal(sig, lambda *_: self.request())


class Backoff:
    """Exponential backoff: `next()` gives the wait to use now and doubles the next one
    up to `maximum`; `reset()` after a success starts again from `initial`. `backing_off`
    says whether there is anything to reset (a hot loop checks it, not calling reset()
    after every success)."""

    def __init__(self, initial: float, maximum: float, factor: float = 2.0) -> None:
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self.current = initial
        self.backing_off = False

    def next(self) -> float:
        wait = self.current
        self.current = min(self.current * self.factor, self.maximum)
        self.backing_off = True
        return wait

    def reset(self) -> None:
        self.current = self.initial
        self.backing_off = False


def add_metrics_arguments(parser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Serve Prometheus metrics on this port [none].",
    )
    parser.add_argument(
        "--metrics-host",
        default=None,
        help="Address the metrics server binds [JOBS_METRICS_HOST, 127.0.0.1]; "
        "0.0.0.0 for every interface (containers).",
    )


def start_metrics_server(port: int | None, host: str | None = None) -> None:
    """Serve /metrics on host:port; the host defaults to JOBS_METRICS_HOST (127.0.0.1:
    nothing outside this machine reads a process's metrics unless told to)."""
    if port:
        from prometheus_client import start_http_server

        host = host or settings.JOBS_METRICS_HOST
        try:
            start_http_server(port, addr=host)
        except OSError as exc:
            raise CommandError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
