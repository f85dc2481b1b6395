"""The API process's database connections, lent to the thread serving a request (D238).

Django opens a connection per thread. granian runs a process's requests on up to
WEB_THREADS + JOBS_API_WAIT_SLOTS threads (D235), hands each request to whichever idle
thread is next, and every thread kept its own connection: 500 waits arriving at once
opened one each for their first read and PostgreSQL refused the ones past
`max_connections` (a 500). Here a process owns WEB_THREADS sets of connections (one
per database alias, opened lazily, kept for CONN_MAX_AGE as before); a request borrows
one set for its length, waiting for a free one as it waited for a free thread before
the wait slots, and a waiting request gives its set back for the wait. The wait's
threads then hold no connection, and the process never more than WEB_THREADS.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

from django.db import connections

log = logging.getLogger(__name__)

Lent = dict[str, Any]  # alias -> DatabaseWrapper


class Lender:
    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._free: queue.LifoQueue[Lent] = queue.LifoQueue()
        self._lock = threading.Lock()
        self._made = 0
        self._local = threading.local()

    def _make(self) -> Lent:
        lent = {}
        for alias in connections:
            wrapper = connections.create_connection(alias)
            wrapper.inc_thread_sharing()  # used by one thread at a time, not always the same
            lent[alias] = wrapper
        return lent

    def holding(self) -> bool:
        return getattr(self._local, "lent", None) is not None

    def borrow(self) -> None:
        """Give this thread a set of connections, waiting for one to be free."""
        if self.holding():  # an answer the server never closed: the thread keeps its set
            return
        try:
            lent = self._free.get_nowait()
        except queue.Empty:
            with self._lock:
                make = self._made < self.size
                self._made += make
            lent = self._make() if make else self._free.get()
        for alias, wrapper in lent.items():
            connections[alias] = wrapper
        self._local.lent = lent

    def give_back(self) -> None:
        """Return this thread's set; its next use of the database would open one of its
        own, so requests borrow first."""
        lent, self._local.lent = self._local.lent, None
        for alias, wrapper in lent.items():
            with contextlib.suppress(AttributeError):
                del connections[alias]
            if wrapper.in_atomic_block:
                self._discard(wrapper)  # never lend a transaction left open
        self._free.put(lent)

    @staticmethod
    def _discard(wrapper: Any) -> None:
        try:
            wrapper.in_atomic_block = False
            wrapper.close()
        except Exception as exc:
            log.warning("closing a lent connection failed: %s", exc)

    @contextlib.contextmanager
    def lent(self) -> Iterator[None]:
        """A set of connections for the block, unless this thread holds one already."""
        if self.holding():
            yield
            return
        self.borrow()
        try:
            yield
        finally:
            self.give_back()


_lender: Lender | None = None


def install(size: int) -> Lender:
    """Lend connections in this process (the WSGI entry point calls it once)."""
    global _lender
    _lender = Lender(size)
    return _lender


def lender() -> Lender | None:
    return _lender


@contextlib.contextmanager
def for_background() -> Iterator[None]:
    """A set of connections for a background thread's work (the waiter's poll); without
    a lender (tests, commands) the thread's own connection, closed afterwards."""
    if _lender is not None:
        with _lender.lent():
            yield
        return
    try:
        yield
    finally:
        connections.close_all()


@contextlib.contextmanager
def released() -> Iterator[None]:
    """No connection held for the block (a wait): the set goes back to the process and
    another is borrowed after; without a lender, the thread's own is closed."""
    if _lender is not None and _lender.holding():
        _lender.give_back()
        try:
            yield
        finally:
            _lender.borrow()
        return
    connections.close_all()
    yield


class LendingApp:
    """WSGI: each request runs with a borrowed set, given back when the server closes the
    answer (after request_finished, which Django sends from the answer's close())."""

    def __init__(self, app: Any, size: int) -> None:
        self.app = app
        self.lender = install(size)

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        self.lender.borrow()
        try:
            answer = self.app(environ, start_response)
        except BaseException:
            self.lender.give_back()
            raise
        return _GiveBack(answer, self.lender)


class _GiveBack:
    def __init__(self, answer: Any, lender: Lender) -> None:
        self.answer = answer
        self.lender = lender

    def __iter__(self) -> Any:
        return iter(self.answer)

    def close(self) -> None:
        try:
            close = getattr(self.answer, "close", None)
            if close is not None:
                close()
        finally:
            if self.lender.holding():
                self.lender.give_back()
