"""manage.py runstack — the whole service for development: API, worker(s), reaper.

`make run` calls this. It creates the database when missing, migrates, collects
static files for the admin, then supervises the API server, the workers and the reaper as
child processes: a signal stops them all, and any child dying stops the rest. An
embedded PostgreSQL (DATABASE_URL unset) is stopped too when everything has exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from jobs import queues
from jobs.conf import settings


def served_queues() -> str:
    """Every declared queue, equal weights: a queue added to JOBS_QUEUES is served by
    `make run` at once instead of waiting silently (runworker's own default is
    `default,webhooks`)."""
    return ",".join(f"{name}:1" for name in queues.declared())


class Command(BaseCommand):
    help = "Run the API (granian or gunicorn), worker(s) and the reaper together."

    def add_arguments(self, parser):
        parser.add_argument("--bind", default="127.0.0.1:8000", help="API address [%(default)s].")
        parser.add_argument(
            "--workers", type=int, default=1, help="runworker processes [%(default)s]."
        )
        parser.add_argument(
            "--concurrency", type=int, default=4, help="Jobs per worker [%(default)s]."
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=9101,
            help="Worker n serves metrics on this port + 100 × (n - 1) (9101, 9201, …), "
            "the reaper on this port + 1 [%(default)s].",
        )
        parser.add_argument("--no-migrate", action="store_true", help="Skip ensuredb and migrate.")

    def handle(self, *args, **opts):
        if not settings.SETTINGS_MODULE.startswith("jobservice."):
            raise CommandError(
                "runstack runs the jobservice deployment from its checkout (make run); in "
                "your own project run `manage.py runworker` and `manage.py runreaper` "
                "beside your web server (docs/django.md)"
            )
        if opts["workers"] < 1:
            raise CommandError("--workers must be at least 1")
        env = dict(os.environ)
        embedded = not env.get("DATABASE_URL")
        if embedded:
            from jobservice.embedded import database_url

            env["DATABASE_URL"] = database_url(settings.BASE_DIR)
            self.stdout.write(f"embedded PostgreSQL: {env['DATABASE_URL']}")
        if not opts["no_migrate"]:
            call_command("ensuredb")
            call_command("migrate", interactive=False, verbosity=1)
        call_command("collectstatic", interactive=False, verbosity=0)
        env.setdefault("DEBUG", "1" if settings.DEBUG else "0")
        env["BIND"] = opts["bind"]
        manage = [sys.executable, str(settings.BASE_DIR / "manage.py")]
        commands = {
            # JOBS_HTTP_SERVER picks granian (default) or gunicorn (D135).
            "api": [sys.executable, "-m", "jobservice.serve"],
            "reaper": [*manage, "runreaper", "--metrics-port", str(opts["metrics_port"] + 1)],
        }
        for n in range(opts["workers"]):
            commands[f"worker-{n + 1}"] = [
                *manage,
                "runworker",
                "--concurrency",
                str(opts["concurrency"]),
                "--queues",
                served_queues(),
                "--metrics-port",
                str(opts["metrics_port"] + 100 * n),
            ]
        if not settings.REDIS_URL:
            self.stdout.write("REDIS_URL unset: workers claim by polling PostgreSQL")
        # The API server aggregates its workers' metrics through a multiprocess
        # directory (gunicorn.conf.py); workers and the reaper each serve their own.
        single = {k: v for k, v in env.items() if k.upper() != "PROMETHEUS_MULTIPROC_DIR"}
        children = {
            # Own sessions: a terminal Ctrl-C reaches only us, and we stop each child once.
            name: subprocess.Popen(
                cmd,
                env=env if name == "api" else single,
                cwd=settings.BASE_DIR,
                start_new_session=True,
            )
            for name, cmd in commands.items()
        }
        self.stdout.write(
            f"API on http://{opts['bind']}/ (admin /admin/, docs /api/v1/docs/); "
            f"{opts['workers']} worker(s) serving {', '.join(queues.declared())} "
            "(every queue of JOBS_QUEUES), 1 reaper. Ctrl-C stops everything."
        )
        stopping = False

        def stop(*_):
            nonlocal stopping
            for p in children.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM if not stopping else signal.SIGKILL)
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        code = 0
        while any(p.poll() is None for p in children.values()):
            for name, p in children.items():
                if p.poll() is not None and not stopping:
                    self.stderr.write(f"{name} exited with {p.returncode}; stopping the rest")
                    code = p.returncode or 1
                    stop()
            time.sleep(0.2)
        if embedded:
            from jobservice.embedded import stop as stop_embedded

            connections.close_all()
            stop_embedded(settings.BASE_DIR)
            self.stdout.write("embedded PostgreSQL stopped")
        if code:
            raise CommandError(f"a child process failed (exit {code})")
