"""A total wall-clock bound on one HTTP exchange: connect, send and the whole answer.

A socket's timeouts bound each connect and each read, so a receiver that sends one byte
before every read timeout ends holds the call for as long as it likes. `Deadline`
keeps a duplicate of each socket the exchange opens and, when the total is spent,
shuts the connection down through it: a blocked recv or send returns at once, TLS
included (the duplicate outlives the plain socket that TLS wraps and detaches).
"""

from __future__ import annotations

import heapq
import os
import socket
import threading
import time

import urllib3


class DeadlineExceeded(urllib3.exceptions.TimeoutError):
    """The exchange did not end within its total deadline."""


class Deadline:
    """`with Deadline(seconds) as d:` — the sockets given to `d.watch_shared` are
    shut down `seconds` after entry."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._at = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._shared: list[socket.socket] = []  # the connection's duplicates: shut, not closed
        self._expired = False

    def __enter__(self) -> Deadline:
        self._at = time.monotonic() + self.seconds
        _CLOCK.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _CLOCK.remove(self)
        with self._lock:  # not while _expire shuts one down: its fd could be reused
            self._shared = []

    @property
    def expired(self) -> bool:
        return self._expired or time.monotonic() >= self._at

    def remaining(self) -> float:
        return max(0.0, self._at - time.monotonic())

    def watch_shared(self, dup: socket.socket) -> None:
        """Shut `dup` (a kept-alive connection's own duplicate, which outlives this
        exchange) down at the deadline; it is not closed here."""
        with self._lock:
            self._shared.append(dup)
            if self._expired:
                _shut(dup)

    def _expire(self) -> None:
        with self._lock:
            self._expired = True
            for dup in self._shared:
                _shut(dup)


class _Clock:
    """One thread for every deadline of the process (not a timer thread per attempt):
    it sleeps until the earliest one and expires those due."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Deadline]] = []
        self._live: set[int] = set()
        self._thread: threading.Thread | None = None

    def add(self, deadline: Deadline) -> None:
        with self._cond:
            heapq.heappush(self._heap, (deadline._at, id(deadline), deadline))
            self._live.add(id(deadline))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="webhook-deadlines",
                                                daemon=True)  # fmt: skip
                self._thread.start()
            self._cond.notify()

    def remove(self, deadline: Deadline) -> None:
        with self._cond:
            self._live.discard(id(deadline))

    def _run(self) -> None:
        while True:
            due: list[Deadline] = []
            with self._cond:
                while self._heap and id(self._heap[0][2]) not in self._live:
                    heapq.heappop(self._heap)  # ended in time
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    _, key, deadline = heapq.heappop(self._heap)
                    if key in self._live:
                        self._live.discard(key)
                        due.append(deadline)
                if not due:
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
            for deadline in due:
                deadline._expire()


_CLOCK = _Clock()
# A forked child starts with no deadline of its parent's (nor its thread).
os.register_at_fork(after_in_child=_CLOCK.__init__)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the other side
