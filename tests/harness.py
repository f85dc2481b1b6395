"""Real processes for end-to-end tests: workers, reapers and a private Redis server.

Nothing here fakes a service: a private `redis-server` is started on a free port
so tests may stop, freeze or flush it without touching the shared one.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.db import connection

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def database_url() -> str:
    """A URL for the database this test process uses (the test database)."""
    s = connection.settings_dict
    auth = s["USER"] + (f":{s['PASSWORD']}" if s.get("PASSWORD") else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def wait_until(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.05, message: str = "condition"
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


class RedisServer:
    """A private redis-server on a free port; stop/start/freeze/flush it at will."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
        )
        wait_until(self.ping, 10, message=f"redis on {self.port}")
        return self

    def client(self):
        """A redis-py client for this server (short timeouts: a stopped server errors fast)."""
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=1)

    def ping(self) -> bool:
        try:
            return self.cli("PING") == "PONG"
        except Exception:
            return False

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def flushall(self) -> None:
        assert self.cli("FLUSHALL") == "OK"


class Proc:
    """A manage.py subprocess (runworker, runreaper, ...) with its output captured."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.args = args
        self.log_path = log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), *args],
            env=env,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(10)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._log.close()
        return code

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None


class Stack:
    """Start workers and reapers against the test database and a Redis URL."""

    def __init__(
        self, tmp_path: Path, redis_url: str = "", prefix: str = "e2e:", **env: str
    ) -> None:
        self.tmp = tmp_path
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "jobservice.settings",
            "DATABASE_URL": database_url(),
            "REDIS_URL": redis_url,
            "JOBS_REDIS_PREFIX": prefix,
            "JOBS_TASK_MODULES": "demo.tasks",
            "LOG_LEVEL": "INFO",
            **env,
        }
        self.procs: list[Proc] = []

    def start(self, *args: str, **env: str) -> Proc:
        name = f"{args[0]}-{len(self.procs)}.log"
        p = Proc(list(args), {**self.env, **env}, self.tmp / name)
        self.procs.append(p)
        return p

    def worker(self, *args: str, **env: str) -> Proc:
        return self.start("runworker", *args, **env)

    def reaper(self, *args: str, **env: str) -> Proc:
        return self.start("runreaper", *args, **env)

    def close(self) -> None:
        for p in self.procs:
            if p.alive():
                p.signal(signal.SIGCONT)
                p.kill()
            elif not p._log.closed:
                p._log.close()

    def logs(self) -> str:
        return "\n".join(f"--- {p.args} ---\n{p.output()}" for p in self.procs)
