"""`python -m jobservice.serve`: the API's HTTP server, as `make run`, the image and compose run it.

JOBS_HTTP_SERVER picks the server (D135): `granian` (the default: keep-alive connections
served by a pool of threads in each worker process, so a client's connection pinned to
one process still has that process's threads) or `gunicorn` (gunicorn.conf.py as it is,
sync workers unless WEB_WORKER_CLASS says otherwise). Both read the same settings from
gunicorn.conf.py (BIND, WEB_CONCURRENCY, WEB_THREADS, WEB_KEEPALIVE, WEB_ACCESS_LOG, the
log format) and both aggregate the workers' metrics through the directory it prepares.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
CONF = BASE_DIR / "gunicorn.conf.py"
APP = "jobservice.wsgi:application"
SERVERS = ("granian", "gunicorn")
DEFAULT_SERVER = "granian"
# Threads per granian worker process when WEB_THREADS is unset: enough for the
# connections a process holds to overlap their waits on PostgreSQL (D136).
GRANIAN_THREADS = 4


def server_name(env: dict[str, str] | os._Environ = os.environ) -> str:
    name = (env.get("JOBS_HTTP_SERVER") or DEFAULT_SERVER).strip().lower()
    if name not in SERVERS:
        raise SystemExit(f"JOBS_HTTP_SERVER={name!r}: expected one of {', '.join(SERVERS)}")
    return name


def wait_slots(env: dict[str, str] | os._Environ = os.environ) -> int:
    """JOBS_API_WAIT_SLOTS as the workers will read it (the environment, else the default)."""
    from jobs.conf import SETTINGS

    return int(env.get("JOBS_API_WAIT_SLOTS") or SETTINGS["JOBS_API_WAIT_SLOTS"].default)


def gunicorn_argv(extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "gunicorn", "-c", str(CONF), APP, *extra]


def granian(conf: dict) -> None:
    """Serve with granian in this process (it spawns the workers), then clean up as
    gunicorn's master does on exit."""
    from granian import Granian
    from granian.constants import HTTPModes, Interfaces
    from granian.http import HTTP1Settings

    host, _, port = conf["bind"].rpartition(":")
    # Plus one thread per wait a process may hold (`?wait=`, D235): a waiting request
    # sleeps in its thread, holding no database connection; granian starts threads on
    # demand and ends idle ones, so they cost nothing until waits come.
    threads = int(os.environ.get("WEB_THREADS") or GRANIAN_THREADS) + wait_slots()
    log = conf.get("logconfig_dict")
    if log:  # gunicorn's logger names -> granian's, same handlers and format
        log = {**log, "loggers": {"_granian": log["loggers"]["gunicorn.error"],
                                  "granian.access": log["loggers"]["gunicorn.access"]}}  # fmt: skip
    server = Granian(
        APP,
        address=host.strip("[]") or "127.0.0.1",
        port=int(port),
        interface=Interfaces.WSGI,
        workers=conf["workers"],
        blocking_threads=threads,
        # granian's backpressure bounds a process's open connections, not its requests:
        # at `threads` a fifth kept-alive connection waited, unaccepted, until another
        # closed (D149). Its own default (backlog / workers) admits them all.
        backpressure=None,
        http=HTTPModes.http1,
        websockets=False,
        http1_settings=HTTP1Settings(keep_alive=conf["keepalive"] > 0),
        log_dictconfig=log,
        log_access=bool(conf.get("accesslog")),
        respawn_failed_workers=True,
        respawn_interval=1.0,
        workers_kill_timeout=conf["graceful_timeout"],
        working_dir=BASE_DIR,
    )
    try:
        server.serve()
    finally:
        conf["on_exit"](None)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if server_name() == "gunicorn":
        os.chdir(BASE_DIR)
        os.execv(sys.executable, gunicorn_argv(argv))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "jobservice.settings")
    granian(runpy.run_path(str(CONF)))


if __name__ == "__main__":
    main()
