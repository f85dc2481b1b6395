"""The API server's settings, from the environment: gunicorn's, and granian's too
(`jobservice.serve` reads this file for either, D135).

Metrics: gunicorn runs several worker processes, each with its own counters, and
a scrape reaches only one of them. prometheus-client's multiprocess mode makes
every worker write its metrics to files in PROMETHEUS_MULTIPROC_DIR and the
/metrics view sum them (django-prometheus serves a MultiProcessCollector when the
variable is set). The directory is chosen and emptied here, when the master
starts and before any worker imports prometheus_client (which reads the variable
on import); a dead worker's live gauges are dropped in `child_exit`. Counters of
dead workers stay in the directory, so totals survive worker restarts.
"""

import os
import shutil
import tempfile

bind = os.environ.get("BIND", "127.0.0.1:8000")
workers = int(os.environ.get("WEB_CONCURRENCY", "2"))
threads = int(os.environ.get("WEB_THREADS", "1"))
# sync by default: it closes a connection after each answer, so every request is free to
# go to the least busy worker. gthread keeps a client's connection open (WEB_KEEPALIVE s),
# which spares a TCP handshake per request (8 % more single submissions with 8 clients)
# but pins each connection to one worker process: two clients posting batches halved
# the batch figure when both connections landed on the same worker (D75).
worker_class = os.environ.get("WEB_WORKER_CLASS", "sync")
keepalive = int(os.environ.get("WEB_KEEPALIVE", "5"))
timeout = int(os.environ.get("WEB_TIMEOUT", "30"))
graceful_timeout = 10
accesslog = os.environ.get("WEB_ACCESS_LOG") or None
errorlog = "-"
# The metrics directory is emptied at start: workers must import the app after that.
preload_app = False

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_PREPARED_ENV = "JOBS_METRICS_DIR_PREPARED_BY"  # master pid that emptied it (reloads keep it)
_OWN_PREFIX = "jobservice-api-metrics-"


def _metrics_dir() -> str:
    """The multiprocess directory: $PROMETHEUS_MULTIPROC_DIR, else a fresh one per master.

    Emptied once per master start: files left by an earlier run would be summed into
    this one's counters. A configuration reload (SIGHUP) re-reads this file in the same
    master and keeps the files, so counters do not reset on reload.
    """
    path = os.environ.get(MULTIPROC_ENV) or os.path.join(
        tempfile.gettempdir(), f"{_OWN_PREFIX}{os.getpid()}"
    )
    if os.environ.get(_PREPARED_ENV) != str(os.getpid()):
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path):
            if name.endswith(".db"):
                os.remove(os.path.join(path, name))
        os.environ[_PREPARED_ENV] = str(os.getpid())
    os.environ[MULTIPROC_ENV] = path
    return path


metrics_dir = _metrics_dir()


def child_exit(server, worker):
    """A worker died or was replaced: drop its live gauges (its counters stay summed)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid, metrics_dir)


def on_exit(server):
    """Remove the directory if this master made it (an operator's own is left in place)."""
    if os.path.basename(metrics_dir) == f"{_OWN_PREFIX}{os.getpid()}":
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _log_format() -> str:
    """LOG_FORMAT as jobservice/settings.py reads it: json by default in production."""
    truthy = ("1", "true", "yes", "on", "y", "t")
    production = os.environ.get("JOBS_PRODUCTION", "").strip().lower() in truthy
    return os.environ.get("LOG_FORMAT") or ("json" if production else "text")


# gunicorn's own lines (boot, worker exits, timeouts, access log) in the service's format,
# so that a JSON log pipeline never meets a plain-text line from the API's processes.
if _log_format() == "json":
    logconfig_dict = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "jobs.logconfig.JsonFormatter"}},
        "handlers": {
            "error_console": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "stream": "ext://sys.stderr",
            },
            "console": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "stream": "ext://sys.stdout",
            },
        },
        "loggers": {
            "gunicorn.error": {"level": "INFO", "handlers": ["error_console"], "propagate": False},
            # Access lines only when asked for (WEB_ACCESS_LOG); they go to stdout.
            "gunicorn.access": {
                "level": "INFO" if accesslog else "WARNING",
                "handlers": ["console"],
                "propagate": False,
            },
        },
        "root": {"level": "INFO", "handlers": []},
    }
