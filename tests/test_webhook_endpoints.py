"""An endpoint's slots held by the delivery process (issue 41), against real PostgreSQL
sessions and real sockets on 127.0.0.1: a delivery to a busy fast endpoint waits for a
slot of its process instead of parking, a slow endpoint's still park, the bound holds
across sessions, and a kept-alive connection is reused yet still ended by the deadline."""

from __future__ import annotations

import socket
import threading
import time

import psycopg
import pytest

from jobs.events import endpoints
from jobs.events.deadline import DeadlineExceeded
from jobs.events.webhooks import post
from tests.harness import database_url, wait_until

WEBHOOK = 4141


@pytest.fixture
def slots(db, settings):
    settings.JOBS_WEBHOOK_ENDPOINT_CONCURRENCY = 1
    found = endpoints.Slots()
    yield found
    found.close()


def held_elsewhere(number: int, webhook: int = WEBHOOK) -> bool:
    """Whether another session can take the slot now (it then gives it back)."""
    with psycopg.connect(database_url(), autocommit=True) as conn:
        key = [endpoints.ENDPOINT_LOCK_SPACE + number, webhook]
        if conn.execute("SELECT pg_try_advisory_lock(%s, %s)", key).fetchone()[0]:
            conn.execute("SELECT pg_advisory_unlock(%s, %s)", key)
            return False
        return True


def test_a_busy_fast_endpoint_hands_its_slot_over_instead_of_parking(slots):
    first = slots.take(WEBHOOK)
    assert first is not None and held_elsewhere(0)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(slots.take(WEBHOOK)))
    waiter.start()
    time.sleep(0.05)  # the waiter finds the only slot busy and waits for it
    first.give(seconds=0.002)  # a fast call
    waiter.join(5)
    assert got and got[0].slot is first.slot  # its lock never given back between
    assert held_elsewhere(0)
    got[0].give(seconds=0.002)
    first.give()  # a second give of a use given back already: the slot stays in use
    assert held_elsewhere(0) and slots.release_idle() == 1 and not held_elsewhere(0)


def test_a_slow_endpoint_parks_at_once(slots):
    first = slots.take(WEBHOOK)
    first.give(seconds=5.0)  # its calls take seconds
    again = slots.take(WEBHOOK)
    assert again.slot is first.slot
    started = time.monotonic()
    assert slots.take(WEBHOOK) is None  # a second waits for nothing: it parks
    assert time.monotonic() - started < 0.1
    again.give()


def test_a_kept_session_the_server_ended_does_not_park_a_delivery(slots):
    first = slots.take(WEBHOOK)
    pid = first.slot.session.info.backend_pid
    first.give()
    assert slots.release_idle() == 1  # its session is kept for the next slot
    with psycopg.connect(database_url(), autocommit=True) as other:
        assert other.execute("SELECT pg_terminate_backend(%s, 10000)", [pid]).fetchone()[0]
    again = slots.take(WEBHOOK)
    assert again is not None and again.slot.session.info.backend_pid != pid
    assert held_elsewhere(0)
    again.give()


def test_no_slot_when_other_processes_hold_them_all(slots, settings):
    settings.JOBS_WEBHOOK_ENDPOINT_CONCURRENCY = 2
    with psycopg.connect(database_url(), autocommit=True) as other:
        for number in range(2):
            other.execute("SELECT pg_advisory_lock(%s, %s)",
                          [endpoints.ENDPOINT_LOCK_SPACE + number, WEBHOOK])  # fmt: skip
        assert slots.take(WEBHOOK) is None
        other.execute("SELECT pg_advisory_unlock(%s, %s)",
                      [endpoints.ENDPOINT_LOCK_SPACE + 1, WEBHOOK])  # fmt: skip
        taken = slots.take(WEBHOOK)
        assert taken is not None and taken.slot.number == 1
        taken.give()
        other.execute("SELECT pg_advisory_unlock_all()")


class KeepAlive:
    """Answers 200 on one kept-alive connection: the first request at once, the
    second one byte every `every` seconds. Counts the connections accepted."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.accepted = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        try:
            for n in range(2):
                data = b""
                while b"\r\n\r\n" not in data or not data.endswith(b"{}"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                if n == 0:
                    conn.sendall(answer)
                    continue
                for byte in answer:
                    conn.sendall(bytes([byte]))
                    if self.closed.wait(self.every):
                        return
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.closed.set()
        self.server.close()


def test_a_kept_alive_connection_is_reused_and_still_ends_at_the_deadline(settings):
    settings.JOBS_WEBHOOK_READ_TIMEOUT = 10.0
    receiver = KeepAlive(0.2)
    slot = endpoints.Slot(WEBHOOK, 0, None)
    url = f"http://127.0.0.1:{receiver.port}/h"
    try:
        assert post(url, "127.0.0.1", {}, "{}", seconds=1.5, slot=slot)[0] == 200
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="within 1.5 s"):
            post(url, "127.0.0.1", {}, "{}", seconds=1.5, slot=slot)
        took = time.monotonic() - started
        assert receiver.accepted == 1  # the second call went on the first connection
        assert 1.5 <= took < 2.0
        assert not slot.connections  # a connection a deadline ended is not kept
    finally:
        slot.close_connections()
        receiver.close()


def test_a_delivery_lends_its_call_to_the_run_holding_its_endpoints_slot(slots):
    assert slots.lend(WEBHOOK, lambda slot: (200, b"", {}), 0.05) is None  # no run: take
    got: list = []

    def lend(answer: bytes) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: got.append(slots.lend(WEBHOOK, lambda slot: (200, answer, {}), 5))
        )
        thread.start()
        return thread

    with slots.running(WEBHOOK):
        first = lend(b"made by the run")
        wait_until(lambda: slots.waiting_calls(WEBHOOK) == 1, 5, "the call lent")
        (item,) = slots.lent(WEBHOOK)
        item.answer, item.called = item.call(None), True
        item.done.set()
        first.join(5)
        assert got[0].answer == (200, b"made by the run", {})
        second = lend(b"never made")
        wait_until(lambda: slots.waiting_calls(WEBHOOK) == 1, 5, "the call lent")
    second.join(5)  # the run ended with it untaken: back uncalled, the caller takes a slot
    assert got[1] is None and slots.waiting_calls(WEBHOOK) == 0
