"""The bench's private world: a scratch database, a private redis-server, real processes.

Nothing here touches the shared Redis or any existing database: the bench
creates `jobservice_bench_<unique>` on the PostgreSQL server named by
BENCH_DATABASE_URL (default: the test server), migrates it, and drops it at
the end; Redis is a `redis-server` of its own on a free port.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SERVER = "postgres://root@127.0.0.1:5432/postgres"
TASK_MODULES = "demo.tasks,bench.tasks"
PREFIX = "bench:"


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def _with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


class ScratchDatabase:
    """CREATE DATABASE jobservice_bench_<unique>; DROP ... WITH (FORCE) on close."""

    def __init__(self, server_url: str | None = None) -> None:
        self.server_url = server_url or os.environ.get("BENCH_DATABASE_URL", DEFAULT_SERVER)
        self.name = f"jobservice_bench_{os.getpid()}_{secrets.token_hex(3)}"
        self.url = _with_db(self.server_url, self.name)

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.server_url, autocommit=True) as conn:
            conn.execute(sql)

    def create(self) -> ScratchDatabase:
        self._admin(f'CREATE DATABASE "{self.name}"')
        return self

    def drop(self) -> None:
        self._admin(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


class Redis:
    """A private redis-server on a free port (never the shared one)."""

    def __init__(self) -> None:
        from tests.harness import RedisServer

        self.server = RedisServer()

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> Redis:
        self.server.start()
        return self

    def flush(self) -> None:
        self.server.flushall()

    def stop(self) -> None:
        self.server.stop()


def setup_django(db_url: str, redis_url: str, **settings_env: str) -> None:
    """Configure this process for the scratch database and private Redis, then migrate."""
    os.environ.update(
        DJANGO_SETTINGS_MODULE="jobservice.settings",
        DATABASE_URL=db_url,
        REDIS_URL=redis_url,
        JOBS_REDIS_PREFIX=PREFIX,
        JOBS_TASK_MODULES=TASK_MODULES,
        LOG_LEVEL="WARNING",
        **settings_env,
    )
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)


class Code:
    """Where worker processes run from: this checkout, or a git ref exported to a temp dir
    (for side-by-side before/after runs on the same database and the same machine)."""

    def __init__(self, ref: str | None = None) -> None:
        self.ref = ref
        self._tmp: str | None = None
        if ref is None:
            self.root = ROOT
            self.label = "current"
        else:
            self._tmp = tempfile.mkdtemp(prefix="jobservice-bench-")
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", self._tmp], input=archive, check=True)
            # The bench's own helper tasks must be importable from the old tree too.
            shutil.copytree(ROOT / "bench", Path(self._tmp) / "bench", dirs_exist_ok=True)
            self.root = Path(self._tmp)
            sha = subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", ref],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
            self.label = f"{ref}@{sha}"

    def close(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


class Proc:
    """A `manage.py` subprocess with its output in a log file."""

    def __init__(self, code: Code, args: list[str], env: dict[str, str], log: Path) -> None:
        self.args = args
        self.log_path = log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(code.root / "manage.py"), *args],
            env=env,
            cwd=code.root,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 20) -> int | None:
        self.signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            code = self.proc.wait(10)
        self._log.close()
        return code

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()


class Processes:
    """Starts workers/reapers/gunicorn for the scratch database; stops them all on close."""

    def __init__(self, db_url: str, redis_url: str, logdir: Path, **env: str) -> None:
        self.logdir = logdir
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "jobservice.settings",
            "DATABASE_URL": db_url,
            "REDIS_URL": redis_url,
            "JOBS_REDIS_PREFIX": PREFIX,
            "JOBS_TASK_MODULES": TASK_MODULES,
            "LOG_LEVEL": "INFO",
            "PYTHONPATH": "",
            **env,
        }
        self.procs: list[Proc] = []

    def start(self, code: Code, *args: str, **env: str) -> Proc:
        log = self.logdir / f"{args[0]}-{len(self.procs)}.log"
        proc = Proc(code, list(args), {**self.env, **env}, log)
        self.procs.append(proc)
        return proc

    def worker(self, code: Code, *args: str, ready: bool = True, **env: str) -> Proc:
        proc = self.start(code, "runworker", *args, **env)
        if ready:
            wait_until(
                lambda: "worker started" in proc.output() or not proc.alive(),
                60,
                "worker to start",
            )
            if not proc.alive():
                raise RuntimeError(f"worker exited at start:\n{proc.output()}")
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.alive():
                proc.signal(signal.SIGCONT)
                proc.stop()
        self.procs = []
