"""`python -m jobservice.serve`: the API's HTTP server, as `make run`, the image and compose run it.

JOBS_HTTP_SERVER picks the server (D135): `granian` (the default: keep-alive connections
served by a pool of threads in each worker process, so a client's connection pinned to
one process still has that process's threads) or `gunicorn` (gunicorn.conf.py as it is,
sync workers unless WEB_WORKER_CLASS says otherwise). Both read the same settings from
gunicorn.conf.py (BIND, WEB_CONCURRENCY, WEB_THREADS, WEB_KEEPALIVE, WEB_ACCESS_LOG, the
log format), granian also WEB_MAX_CONNECTIONS (D203), and both aggregate the workers'
metrics through the directory it prepares.
"""

from __future__ import annotations

import os
import resource
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
# Connections a granian worker process accepts at once when WEB_MAX_CONNECTIONS is unset.
MAX_CONNECTIONS = 1024
# Descriptors a worker keeps for what is not a client: its database and Redis
# connections, the metrics files, its logs.
FD_RESERVE = 128


def server_name(env: dict[str, str] | os._Environ = os.environ) -> str:
    name = (env.get("JOBS_HTTP_SERVER") or DEFAULT_SERVER).strip().lower()
    if name not in SERVERS:
        raise SystemExit(f"JOBS_HTTP_SERVER={name!r}: expected one of {', '.join(SERVERS)}")
    return name


def web_threads(env: dict[str, str] | os._Environ = os.environ) -> int:
    """WEB_THREADS: a process's request threads, and its database connections (D238)."""
    return int(env.get("WEB_THREADS") or GRANIAN_THREADS)


def wait_slots(env: dict[str, str] | os._Environ = os.environ) -> int:
    """JOBS_API_WAIT_SLOTS as the workers will read it (the environment, else the default)."""
    from jobs.conf import SETTINGS

    return int(env.get("JOBS_API_WAIT_SLOTS") or SETTINGS["JOBS_API_WAIT_SLOTS"].default)


def gunicorn_argv(extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "gunicorn", "-c", str(CONF), APP, *extra]


def header_timeout_ms(conf: dict) -> int:
    """How long a connection may take to send a request's headers, counted from its
    accept or from the previous answer (hyper's header_read_timeout): WEB_KEEPALIVE, the
    idle bound of a kept-alive connection, or gunicorn's `timeout` without keep-alive
    (D202). granian accepts 1 ms to 60 s."""
    seconds = conf["keepalive"] if conf["keepalive"] > 0 else conf["timeout"]
    return min(60_000, max(1, round(seconds * 1000)))


def raise_open_files(connections: int) -> int:
    """Lift this process's descriptor limit (its workers inherit it) to the hard limit,
    and bound the connections a worker accepts below it: a worker out of descriptors
    fails accept() in a loop instead of queueing clients (D203)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        soft = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return max(1, min(connections, soft - FD_RESERVE))


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
    threads = web_threads() + wait_slots()
    connections = raise_open_files(int(os.environ.get("WEB_MAX_CONNECTIONS") or MAX_CONNECTIONS))
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
        # granian's backpressure bounds a process's open connections, not its requests
        # (D149): far above its threads, so that kept-alive clients are all served, and
        # below its descriptors (D203).
        backpressure=connections,
        backlog=max(2048, connections * conf["workers"]),
        http=HTTPModes.http1,
        websockets=False,
        http1_settings=HTTP1Settings(
            keep_alive=conf["keepalive"] > 0, header_read_timeout=header_timeout_ms(conf)
        ),
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
