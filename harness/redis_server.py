"""A redis-server of the caller's own on a free port: stop, restart, freeze, flush at will.

Never the shared server: a test, a fault or the bench may lose every message here
without touching anyone else's keys. No persistence: a restart comes back empty.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis

from harness.procs import free_port, wait_until


class RedisServer:
    def __init__(self, log: Path | None = None) -> None:
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen | None = None
        self._client = self.client(socket_connect_timeout=0.5)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--daemonize", "no",
                "--loglevel", "warning"]  # fmt: skip
        if self.log is None:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
        else:
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
        wait_until(self.ping, 10, f"redis on port {self.port}")
        return self

    def client(self, **options) -> redis.Redis:
        """A redis-py client for this server (short timeouts: a stopped server errors fast)."""
        return redis.Redis.from_url(
            self.url, **{"socket_timeout": 2, "socket_connect_timeout": 1, **options}
        )

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except redis.RedisError:
            return False

    def cli(self, *args: str) -> str:
        """`redis-cli` against this server; its output, stripped."""
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.running:
            self.proc.kill()
            self.proc.wait(10)
        self._client.connection_pool.disconnect()

    def flushall(self) -> None:
        self._client.flushall()
