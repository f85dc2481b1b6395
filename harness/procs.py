"""Services as real processes: start, signal, kill -9, restart, stop, read their log.

Each service runs in its own session (process group), so a fault or the final teardown
can signal it and everything it spawned (gunicorn's workers), and a Ctrl-C on the
caller does not reach it behind the caller's back.
"""

from __future__ import annotations

import http.client
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class WaitTimeout(TimeoutError, AssertionError):
    """A wait ran out: a timeout to the fault suite and the bench, a failure to a test."""


def wait_until(
    predicate: Callable[[], Any],
    timeout: float,
    what: str = "condition",
    *,
    interval: float = 0.05,
    message: str | None = None,
) -> Any:
    """Poll `predicate` until it returns something true (returned) or `timeout` passes.

    `message` is the tests' older name for `what`.
    """
    what = message or what
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(port: int, path: str = "/healthz", timeout: float = 2) -> bool:
    """True when GET `path` on 127.0.0.1:`port` answers 200; False while it cannot."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def manage(*args: str, root: Path = ROOT) -> list[str]:
    return [sys.executable, str(root / "manage.py"), *args]


def gunicorn(root: Path = ROOT) -> list[str]:
    """gunicorn with gunicorn.conf.py; BIND etc. come from the env."""
    return [sys.executable, "-m", "gunicorn", "-c", str(root / "gunicorn.conf.py"),
            "jobservice.wsgi:application"]  # fmt: skip


def api_server(root: Path = ROOT) -> list[str]:
    """The API as `make run` starts it (`jobservice.serve`: JOBS_HTTP_SERVER picks the
    server); gunicorn for a tree from before that launcher (a bench baseline)."""
    if (root / "jobservice" / "serve.py").exists():
        return [sys.executable, "-m", "jobservice.serve"]
    return gunicorn(root)


def service_env(
    database_url: str,
    redis_url: str,
    prefix: str,
    task_modules: str,
    base: Mapping[str, str] | None = None,
    **extra: str,
) -> dict[str, str]:
    """The environment a manage.py command or gunicorn needs to run against one
    database and one Redis key prefix (on top of `base`, default this process's)."""
    return {
        **(os.environ if base is None else base),
        "DJANGO_SETTINGS_MODULE": "jobservice.settings",
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "JOBS_REDIS_PREFIX": prefix,
        "JOBS_TASK_MODULES": task_modules,
        "LOG_LEVEL": "INFO",
        **extra,
    }


class Service:
    """One process slot (api, worker-2, reaper-1): start, signal, kill, restart, stop.

    Its output goes to `log`: the first start truncates it, a restart appends after a
    banner line.
    """

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.stopped = False  # SIGSTOPped
        self.expected_down = False  # killed on purpose, restart pending

    def start(self) -> Service:
        with open(self.log_path, "ab" if self.starts else "wb") as out:
            if self.starts:
                out.write(f"\n=== start #{self.starts + 1} at {time.strftime('%X')} ===\n".encode())
                out.flush()
            self.proc = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.starts += 1
        self.stopped = False
        self.expected_down = False
        return self

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

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill(self) -> bool:
        """kill -9 the process and everything in its group; reap it."""
        if not self.alive():
            return False
        self._kill_group()
        self.proc.wait(10)
        self.stopped = False
        return True

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGCONT, SIGTERM, wait up to `grace`, then SIGKILL the group; the exit code."""
        if self.proc is None:
            return None
        if self.alive():
            self.signal(signal.SIGCONT, group=True)
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            return None

    def children(self) -> list[int]:
        """Direct children (gunicorn's worker processes under its master)."""
        if not self.alive():
            return []
        try:
            text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return []
        return [int(x) for x in text.split()]

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


class Processes:
    """The stack's processes (workers, reapers, gunicorn) on one environment, each logged
    to `logdir`; `close()` kills what is left, `stop_all()` stops it gracefully."""

    def __init__(self, logdir: Path, env: dict[str, str]) -> None:
        self.logdir = logdir
        self.env = env
        self.procs: list[Service] = []

    def add(self, name: str, argv: list[str], cwd: Path = ROOT, **env: str) -> Service:
        log = self.logdir / f"{name}-{len(self.procs)}.log"
        svc = Service(name, argv, {**self.env, **env}, log, cwd)
        self.procs.append(svc)
        return svc.start()

    def start(self, *args: str, root: Path = ROOT, **env: str) -> Service:
        """`manage.py *args` from the checkout at `root`."""
        return self.add(args[0], manage(*args, root=root), cwd=root, **env)

    def worker(self, *args: str, root: Path = ROOT, ready: bool = False, **env: str) -> Service:
        """`runworker *args`; with `ready`, once it logs that it started (RuntimeError if
        it exits first)."""
        svc = self.start("runworker", *args, root=root, **env)
        if ready:
            wait_until(lambda: "worker started" in svc.output() or not svc.alive(), 60,
                       "worker to start", interval=0.02)  # fmt: skip
            if not svc.alive():
                raise RuntimeError(f"worker exited at start:\n{svc.output()}")
        return svc

    def reaper(self, *args: str, **env: str) -> Service:
        return self.start("runreaper", *args, **env)

    def api(self, port: int, root: Path = ROOT, timeout: float = 60, **env: str) -> Service:
        """The API server on `port`, once it answers /healthz (RuntimeError if it exits first)."""
        svc = self.add("api", api_server(root), cwd=root, BIND=f"127.0.0.1:{port}", **env)
        wait_until(lambda: http_ok(port) or not svc.alive(), timeout,
                   "the API server to answer /healthz", interval=0.1)  # fmt: skip
        if not svc.alive():
            raise RuntimeError(f"the API server exited:\n{svc.output()}")
        return svc

    def close(self) -> None:
        """kill -9 everything still running (thawing it first)."""
        for p in self.procs:
            if p.alive():
                p.signal(signal.SIGCONT)
                p.kill()

    def stop_all(self, grace: float = 20.0) -> None:
        """Stop everything gracefully and forget it."""
        for p in self.procs:
            p.stop(grace)
        self.procs = []

    def logs(self) -> str:
        return "\n".join(f"--- {shlex.join(p.argv[1:])} ---\n{p.output()}" for p in self.procs)
