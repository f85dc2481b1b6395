"""A worker process's presence in PostgreSQL: its registry row and its session lock.

A thread of the worker keeps a connection of its own (not Django's per-thread
ones, which are closed and reopened on errors) and, every JOBS_PRESENCE_SECONDS,
upserts the worker's row in jobs_worker: queues served, hostname, pid, backend
pid, heartbeat. With JOBS_SESSION_CRASH_DETECTION it also holds a session-level
advisory lock on that connection for as long as the process lives. When the
process dies the server ends the session and releases the lock, and the reaper
requeues the worker's jobs at its next check instead of waiting for the lease.
If only the connection dies (pg_terminate_backend, a network blip) the thread
reconnects at once, takes the lock again and beats, well inside the three beats
the reaper allows; jobs requeued meanwhile are fenced off as after any reap.

Behind a pooler in transaction mode a session lock would be held by whichever server
connection ran the statement, not by this process: JOBS_DIRECT_DATABASE_URL names the
server itself, and only this one connection per worker process goes there (D145).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Sequence

import psycopg
from django.db import connection
from psycopg.conninfo import conninfo_to_dict

from jobs import metrics, services
from jobs.conf import settings

log = logging.getLogger(__name__)


def direct_connection_params() -> dict:
    """Django's connection parameters, with the server's own address, user and database
    from JOBS_DIRECT_DATABASE_URL when it is set (the pooler's otherwise)."""
    params = connection.get_connection_params()
    direct = settings.JOBS_DIRECT_DATABASE_URL
    if direct:
        params.update({k: v for k, v in conninfo_to_dict(direct).items() if v})
    return params


class Presence:
    """Registers `worker_id` and keeps it registered until `stop()`."""

    def __init__(
        self,
        worker_id: str,
        queues: Sequence[str],
        concurrency: int,
        interval: float | None = None,
        lock: bool | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.queues = list(queues)
        self.concurrency = concurrency
        self.interval = interval if interval is not None else settings.JOBS_PRESENCE_SECONDS
        self.lock = settings.JOBS_SESSION_CRASH_DETECTION if lock is None else lock
        self.locked = False
        self._conn: psycopg.Connection | None = None
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="presence", daemon=True)

    def start(self) -> None:
        """Register before the first claim (so no job is owned by an unknown worker),
        then keep beating in the background."""
        self.beat()
        self._thread.start()

    def stop(self) -> None:
        """Unregister: the row goes, and closing the session releases the lock."""
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            if self._conn is None:
                self._connect()
            services.worker_leave(self._conn, self.worker_id)
        except psycopg.Error as exc:
            log.warning("could not unregister: %s", exc, extra={"worker_id": self.worker_id})
        self._close()

    def beat(self) -> bool:
        """One registration; False (and the connection dropped) when it failed."""
        try:
            if self._conn is None:
                self._connect()
            self.locked = services.worker_beat(
                self._conn,
                self.worker_id,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                queues=self.queues,
                concurrency=self.concurrency,
                lock=self.lock,
                locked=self.locked,
            )
            return True
        except psycopg.Error as exc:
            metrics.child(metrics.DB_ERRORS, "presence").inc()
            log.warning(
                "presence beat failed, reconnecting: %s", exc, extra={"worker_id": self.worker_id}
            )
            self._close()
            return False

    def _connect(self) -> None:
        conn = connection.get_new_connection(direct_connection_params())
        conn.autocommit = True
        self._conn = conn
        self.locked = False  # a new session holds no lock yet

    def _close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
        self._conn = None
        self.locked = False

    def _loop(self) -> None:
        wait = self.interval
        while not self._halt.wait(wait):
            try:
                ok = self.beat()
            except Exception:  # never let presence end while the worker runs
                log.exception("presence beat failed", extra={"worker_id": self.worker_id})
                self._close()
                ok = False
            if not ok and wait == self.interval:
                # The connection died: reconnect at once (the reaper allows three beats),
                # then every 0.2 s until the server answers again.
                ok = self.beat()
            wait = self.interval if ok else 0.2
