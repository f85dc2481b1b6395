"""The whole service under test, on the harness's own database and Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psycopg

from chaos.profiles import POOL_QUEUE, THROTTLE, THROTTLED_QUEUE, Profile
from harness import (
    ROOT,
    RedisServer,
    ScratchDatabase,
    Service,
    detach,
    free_port,
    gunicorn,
    http_ok,
    interrupt_detach,
    manage,
    service_env,
    wait_until,
)

PREFIX = "chaos:"
# The test tasks the load submits as a client, opened by name (D196): installed, none is
# public in a deployment.
PUBLIC_TASKS = (
    "echo,sleep,fail,demo.record,demo.flaky,demo.permanent,"
    "chaos.bad_result,chaos.hang,chaos.exit,chaos.die,chaos.steps,chaos.nap,chaos.chain"
)
# Variables the harness sets itself; inherited values must not leak into the stack.
_OWN = ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "BIND", "WEB_")


class Stack:
    def __init__(self, profile: Profile, db: ScratchDatabase, logdir: Path) -> None:
        self.profile = profile
        self.db = db
        self.logdir = logdir
        self.redis = RedisServer(logdir / "redis.log")
        self.api_port = free_port()
        self.api = self._service("api", gunicorn())
        worker = manage("runworker", "--concurrency", str(profile.concurrency), "--grace", "2",
                        "--queues", f"default,{THROTTLED_QUEUE},webhooks")  # fmt: skip
        pool = [*worker, "--pool", "processes", "--queues",
                f"default,{POOL_QUEUE},{THROTTLED_QUEUE},webhooks"]  # fmt: skip
        first_pool = profile.workers - profile.pool_workers
        self.workers = [
            self._service(f"worker-{i + 1}", pool, JOBS_TEST_PAUSE_AFTER_END=str(
                self.pause_file(f"worker-{i + 1}")))
            if i >= first_pool
            else self._service(f"worker-{i + 1}", worker)
            for i in range(profile.workers)
        ]  # fmt: skip
        self.reapers = [
            self._service(f"reaper-{i + 1}", manage("runreaper")) for i in range(profile.reapers)
        ]
        self.unexpected_exits: list[str] = []

    @property
    def services(self) -> list[Service]:
        return [self.api, *self.workers, *self.reapers]

    def service(self, name: str) -> Service:
        for svc in self.services:
            if svc.name == name:
                return svc
        raise KeyError(name)

    def _service(self, name: str, argv: list[str], **env: str) -> Service:
        return Service(name, argv, {**self.env(name), **env}, self.logdir / f"{name}.log")

    def pause_file(self, worker: str) -> Path:
        """While it exists, the worker's children pause after each `end` (fault
        `child_pause`; the child reads the path once, at its start)."""
        return self.logdir / f"{worker}.pause-after-end"

    def env(self, app: str) -> dict[str, str]:
        p = self.profile
        base = {k: v for k, v in os.environ.items() if not k.startswith(("JOBS_", *_OWN))}
        return service_env(
            self.db.url(f"chaos-{app}"),
            self.redis.url,
            PREFIX,
            "demo.tasks,chaos.tasks",
            base,
            JOBS_PUBLIC_TASKS=PUBLIC_TASKS,
            JOBS_LEASE_SECONDS=str(p.lease),
            JOBS_REAPER_INTERVAL=str(p.reaper_interval),
            JOBS_LOST_SIGNAL_SECONDS=str(p.lost_signal),
            JOBS_RETRY_BACKOFF_BASE=str(p.backoff_base),
            JOBS_HOT_FINISHED_SECONDS=str(p.hot_finished),
            JOBS_TIMEOUT_GRACE="1",  # chaos.hang's attempts end 1 s after their timeout
            JOBS_QUEUES=json.dumps(
                {"default": {}, POOL_QUEUE: {}, THROTTLED_QUEUE: {"key_rate": THROTTLE}}
            ),
            BIND=f"127.0.0.1:{self.api_port}",
            WEB_CONCURRENCY=str(p.api_processes),
            WEB_THREADS=str(p.api_threads),
            DEBUG="0",
            PYTHONUNBUFFERED="1",
            **p.extra_env,
        )

    def queue_key(self, queue: str) -> str:
        return f"{PREFIX}q:{queue}"

    # --- setup ------------------------------------------------------------------------

    def _manage(self, *args: str) -> str:
        out = subprocess.run(
            manage(*args), env=self.env("setup"), cwd=ROOT, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def migrate(self) -> None:
        self._manage("migrate", "--noinput", "-v", "0")

    def create_client(self, name: str) -> str:
        """`manage.py createclient NAME`; its token is the last line printed."""
        lines = self._manage("createclient", name).strip().splitlines()
        return lines[-1].strip()

    def start(self) -> None:
        self.redis.start()
        for svc in self.services:
            svc.start()
        wait_until(lambda: http_ok(self.api_port), 60, "the API to answer /healthz", interval=0.1)

    # --- during the run ---------------------------------------------------------------------

    def watch(self) -> None:
        """Restart any service that died without a fault killing it, and note it."""
        for svc in self.services:
            if svc.proc is not None and not svc.alive() and not svc.expected_down:
                code = svc.proc.returncode
                self.unexpected_exits.append(
                    f"{svc.name} exited on its own (code {code}); see {svc.log_path}"
                )
                svc.start()

    def heal(self) -> None:
        """After the faults: Redis up, nothing stopped, every service running."""
        if not self.redis.running:
            self.redis.start()
        self.watch()
        for svc in self.services:
            if svc.alive():
                svc.signal(signal.SIGCONT, group=True)
            else:
                svc.start()

    def terminate_backends(self, target: str) -> int:
        """pg_terminate_backend on every connection of one process slot (by application_name)."""
        with psycopg.connect(self.db.url("chaos-injector"), autocommit=True) as conn:
            row = conn.execute(
                """SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                   WHERE datname = current_database() AND application_name = %s""",
                [f"chaos-{target}"],
            ).fetchone()
        return int(row[0])

    def interrupt_detach(self) -> str:
        """The current period's job partition (the newest starting today or before) left
        DETACH … CONCURRENTLY-pending for real (harness.detach); its name."""
        url = self.db.url("chaos-injector")
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(
                r"""SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                    WHERE i.inhparent = 'jobs_job'::regclass
                      AND c.relname ~ '^jobs_job_p[0-9]{8}$'
                      AND to_date(substring(c.relname FROM 11), 'YYYYMMDD') <= current_date
                    ORDER BY c.relname DESC LIMIT 1"""
            ).fetchone()
            if row is None:
                raise RuntimeError("no job partition of the current period yet (no sweep)")
            # The reapers attach the last one again within a sweep or two; past 15 s the
            # fault fails the run (a second detach cannot even start meanwhile).
            wait_until(lambda: not detach.pending(conn, row[0]), 15,
                       f"the reapers to attach {row[0]} again", interval=0.1)  # fmt: skip
        interrupt_detach(url, "jobs_job", row[0])
        return row[0]

    def kill_pid(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def orphan_submit(self, count: int, seed: int) -> list[tuple[int, str]]:
        out = subprocess.run(
            [sys.executable, "-m", "chaos.orphan", str(count), str(seed)],
            env=self.env("orphan"), cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"orphan helper failed ({out.returncode}): {out.stderr[-500:]}")
        rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
        return [(int(job_id), kind) for job_id, kind in rows]

    # --- teardown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        for svc in self.services:
            svc.stop(grace=5)
        self.redis.stop()
