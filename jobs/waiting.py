"""Waiting for a job to end without polling the database per waiter (issue 42.2, D235).

Workers announce the jobs they ended on the Redis channel `<prefix>ends` once their
write-back commits (one PUBLISH per batch). Each process that waits keeps one
`Waiter`: a thread with one subscription to that channel, which wakes the waiters of
the announced ids (a `threading.Event` each), and which looks up every waited id in
one query each JOBS_WAIT_POLL_SECONDS: the bounded fallback for an announcement lost
or never made (the reaper's and staff's ends, Redis down). A waiter holds no database
connection while it waits: callers close theirs first (the API does).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable

from django.db import close_old_connections, connection

from jobs import lending, transport
from jobs.conf import settings
from jobs.lifecycle import TERMINAL
from jobs.models import Job

log = logging.getLogger(__name__)

CHANNEL = "ends"
RECONNECT_SECONDS = 1.0


def channel_name() -> str:
    return f"{settings.JOBS_REDIS_PREFIX}{CHANNEL}"


def announce(job_ids: Iterable[int]) -> None:
    """Tell waiters these jobs ended (after their commit). A hint: a lost one costs a
    waiter at most one fallback poll."""
    ids = list(job_ids)
    if not ids:
        return
    try:
        transport.get_transport().publish(channel_name(), ",".join(map(str, ids)))
    except transport.TransportError as exc:
        log.debug("could not announce %d ended job(s): %s", len(ids), exc)


def _terminal(ids: list[int]) -> set[int]:
    """The waited ids that ended, in one query (on this thread's own connection)."""
    return set(
        Job.objects.filter(pk__in=ids, status__in=list(TERMINAL)).values_list("pk", flat=True)
    )


class Waiter:
    """One per process: fans out announcements and fallback polls to waiting threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[int, set[threading.Event]] = defaultdict(set)
        self._thread: threading.Thread | None = None

    def wait(self, job_id: int, timeout: float) -> bool:
        """Block up to `timeout` s until `job_id` is announced or found terminal; True
        if it was. The caller reads the job again afterwards."""
        event = threading.Event()
        with self._lock:
            self._waiting[job_id].add(event)
            self._start()
        try:
            return event.wait(timeout)
        finally:
            with self._lock:
                events = self._waiting.get(job_id)
                if events is not None:
                    events.discard(event)
                    if not events:
                        del self._waiting[job_id]

    def waiting(self) -> int:
        with self._lock:
            return sum(len(events) for events in self._waiting.values())

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="jobs-waiter", daemon=True)
            self._thread.start()

    def _wake(self, ids: Iterable[int]) -> None:
        with self._lock:
            for job_id in ids:
                for event in self._waiting.get(job_id, ()):
                    event.set()

    def _poll(self) -> None:
        with self._lock:
            ids = list(self._waiting)
        if not ids:
            return
        try:
            with lending.for_background():  # a lent connection in the API (D238)
                close_old_connections()
                ended = _terminal(ids)
        except Exception as exc:  # the database is down: waiters time out as they would
            log.warning("wait fallback poll failed: %s", exc)
        else:
            self._wake(ended)

    def _run(self) -> None:
        subscription = None
        next_poll = time.monotonic()
        while True:
            poll_every = float(settings.JOBS_WAIT_POLL_SECONDS)
            if subscription is None:
                subscription = self._subscribe()
            timeout = max(0.0, min(next_poll - time.monotonic(), poll_every))
            if subscription is not None:
                try:
                    message = subscription.get_message(
                        ignore_subscribe_messages=True, timeout=timeout
                    )
                except Exception as exc:  # Redis went away: poll until it is back
                    log.warning("wait subscription lost: %s", exc)
                    subscription = None
                    message = None
                if message is not None and message.get("type") == "message":
                    data = message["data"]
                    text = data.decode() if isinstance(data, bytes) else str(data)
                    self._wake(int(x) for x in text.split(",") if x.isdigit())
            else:
                time.sleep(min(timeout, RECONNECT_SECONDS) or 0.01)
            if time.monotonic() >= next_poll:
                self._poll()
                next_poll = time.monotonic() + poll_every

    def _subscribe(self):
        try:
            return transport.get_transport().subscribe(channel_name())
        except transport.TransportError as exc:
            log.debug("wait subscription unavailable: %s", exc)
            return None


_waiter = Waiter()


def waiter() -> Waiter:
    return _waiter


def wait_for(job_id: int, timeout: float) -> Job:
    """The job once it ended, or as it is when `timeout` seconds have passed.

    Releases this thread's database connection for the wait (a caller inside a
    transaction keeps it: it waits on the database it holds)."""
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0, not {timeout!r}")
    job = Job.objects.get(pk=job_id)
    if job.status in TERMINAL or timeout == 0:
        return job
    if not connection.in_atomic_block:
        connection.close()
    _waiter.wait(job_id, timeout)
    return Job.objects.get(pk=job_id)
