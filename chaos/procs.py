"""The processes the harness runs and hurts: its own Redis, the API, workers, reapers.

Each service runs in its own session (process group), so a fault or the final
teardown can signal it and everything it spawned, and a Ctrl-C on the harness
does not reach it behind the harness's back.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


class RedisServer:
    """A redis-server of the harness's own on a spare port: stop, restart, flush at will.

    No persistence: a restart comes back empty, as after losing every message.
    """

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen | None = None
        self._client = redis.Redis(
            host="127.0.0.1", port=self.port, socket_connect_timeout=0.5, socket_timeout=2
        )

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no", "--daemonize", "no",
                 "--loglevel", "warning"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        wait_for(self.ping, 10, f"redis on port {self.port}")

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except redis.RedisError:
            return False

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

    def rpush(self, key: str, ids: list[int]) -> None:
        if ids:
            self._client.rpush(key, *ids)


class Service:
    """One slot of the stack (api, worker-2, reaper-1): start, signal, kill, restart."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logdir: Path) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log = logdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.stopped = False  # SIGSTOPped by a fault
        self.expected_down = False  # killed by a fault, restart pending

    def start(self) -> None:
        with open(self.log, "ab") as out:
            out.write(f"\n=== start #{self.starts + 1} at {time.strftime('%X')} ===\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.argv, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.starts += 1
        self.stopped = False
        self.expected_down = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int, group: bool = False) -> bool:
        """Send `sig` (to the whole process group with `group`); False if not running."""
        if not self.alive():
            return False
        try:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        if sig == signal.SIGSTOP:
            self.stopped = True
        elif sig == signal.SIGCONT:
            self.stopped = False
        return True

    def kill(self) -> bool:
        """kill -9 the process and everything in its group; reap it."""
        if not self.alive():
            return False
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.stopped = False
        return True

    def children(self) -> list[int]:
        """Direct children (gunicorn's worker processes under its master)."""
        if not self.alive():
            return []
        try:
            text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return []
        return [int(x) for x in text.split()]

    def shutdown(self, grace: float = 10.0) -> None:
        """SIGCONT, SIGTERM, wait up to `grace`, then SIGKILL the group."""
        if not self.alive():
            return
        self.signal(signal.SIGCONT, group=True)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def manage(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "manage.py"), *args]


def gunicorn() -> list[str]:
    return [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "gunicorn.conf.py"),
            "jobservice.wsgi:application"]  # fmt: skip
