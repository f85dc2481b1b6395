"""Slow clients against the deployment's front: HAProxy as `python -m jobservice.proxy`
renders it, in front of `python -m jobservice.serve` (issue 39 items 2 and 3; D204-D206,
D250).

The plain server gives a request thread to any body that stalls with a token, or to an
admin login form with a `csrftoken` cookie (CsrfViewMiddleware reads it): 16 such
connections per process starve it. Through the front, the app sees only complete
requests: the others wait in HAProxy and are answered 408 and closed at the
whole-request deadline, however steadily they trickle.

Every test opens a bounded number of real sockets and bounds every wait.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import front as front_proxy
from harness.front import Front
from harness.slow_clients import connect, credentialed_stalls, stall
from jobs.api.parsers import BATCH_BODY_FACTOR, max_body_bytes
from jobs.models import Client, Job
from tests.test_http_edge_e2e import answer, api, assert_served

# One group under `--dist loadgroup`: the module's front and API server
# starts once, not once on each worker.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("http_front"),
    pytest.mark.skipif(front_proxy.available() is not None, reason=str(front_proxy.available())),
]

REQUEST_TIMEOUT = 4  # PROXY_REQUEST_TIMEOUT: request line, headers and body, from the first byte
KEEPALIVE = 4  # PROXY_KEEPALIVE: a kept-alive connection's wait for its next request


@pytest.fixture(scope="module")
def front_server(django_db_setup, tmp_path_factory):
    """HAProxy on a free port in front of a real API server of two processes of four
    threads, for the module: each test closes every socket it opened, and a start of the
    two cost a test's setup 4-15 s on a loaded machine."""
    server = api(tmp_path_factory.mktemp("front"))
    proxy = Front(
        server.port,
        {
            **server.server.env,
            "PROXY_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT),
            "PROXY_KEEPALIVE": str(KEEPALIVE),
        },
    )
    try:
        proxy.start()
        yield proxy, server
    finally:
        assert proxy.stop() == 0
        assert server.stop() == 0


@pytest.fixture
def front(transactional_db, front_server):
    """(the front's port, a token); the front and the server still up after the test."""
    proxy, server = front_server
    _, token = Client.create_with_token("front")
    yield proxy.port, token
    assert proxy.service.alive(), proxy.log()
    assert server.server.alive(), server.output()


def stalled_with_credentials(port: int, token: str, count: int) -> list[socket.socket]:
    """`count` stalled bodies, in turn a lane submission, a batch (DRF) and an admin
    login (a form with a csrftoken cookie)."""
    opener = credentialed_stalls(port, token)
    return [opener() for _ in range(count)]


def assert_answered(socks: list[socket.socket], expected: tuple, seconds: float) -> None:
    """Each connection gets `expected` ((status or None, closed)) within `seconds`."""
    started = time.monotonic()
    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(lambda s: answer(s, seconds), socks))
    took = time.monotonic() - started
    assert answers == [expected] * len(socks), answers
    assert took < seconds, took


class Trickle:
    """`data` sent on `sock` one byte a second until the server closes it (or `data` runs
    out, which the tests make sure it never does in time)."""

    def __init__(self, sock: socket.socket, data: bytes) -> None:
        self.sock = sock
        self.started = time.monotonic()
        self.sent = 0
        self._thread = threading.Thread(target=self._run, args=(data,), daemon=True)
        self._thread.start()

    def _run(self, data: bytes) -> None:
        for byte in data:
            try:
                self.sock.send(bytes([byte]))
            except OSError:
                return
            self.sent += 1
            time.sleep(1)

    def answer(self, within: float) -> tuple[bytes, bool, float]:
        """(what the server sent, whether it closed, seconds since the first byte)."""
        data, closed = read_until_closed(self.sock, within)
        return data, closed, time.monotonic() - self.started


def test_a_request_that_trickles_is_answered_408_at_the_whole_request_deadline(front):
    """Item 2's read deadline: headers sent one byte a second and never finished, and a
    submission whose body (announced 1,000 bytes, with a token) comes one byte a second:
    no pause is ever longer than a second, yet each gets `408` and the close at
    PROXY_REQUEST_TIMEOUT from its first byte. nginx's timeouts are per read: the body
    trickle was never cut and neither was answered 408."""
    port, token = front
    head = ("POST /api/v1/jobs/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Token {token}\r\nContent-Type: application/json\r\n")  # fmt: skip
    headers = Trickle(connect(port), head.encode() + b"X-Padding: " + b"x" * 60)
    body = Trickle(stall(port, "/api/v1/jobs/", f"Authorization: Token {token}",
                         "Content-Type: application/json"), b"x" * 60)  # fmt: skip
    try:
        answers = [t.answer(REQUEST_TIMEOUT + 3) for t in (headers, body)]
    finally:
        headers.sock.close()
        body.sock.close()
    for data, closed, took in answers:
        assert data.startswith(b"HTTP/1.1 408 "), data
        assert closed
        # Cut by the deadline, not by an idle gap: every gap was a second.
        assert REQUEST_TIMEOUT - 0.5 < took < REQUEST_TIMEOUT + 2, took
    assert headers.sent > REQUEST_TIMEOUT - 2 and body.sent > REQUEST_TIMEOUT - 2
    # The body's refusal is the app's JSON shape.
    assert json.loads(answers[1][0].partition(b"\r\n\r\n")[2])["code"] == "request_timeout"
    assert Job.objects.count() == 0


def test_stalled_bodies_with_credentials_wait_in_the_front(front):
    """Item 2 with credentials: 16 stalled lane submissions, 16 stalled batches and 16
    stalled admin logins (48, six times the eight request threads) → /healthz and a
    submission are answered within 1 s; each stalled connection is answered 408 and
    closed at the request deadline, and none of them reached the app (no job)."""
    port, token = front
    socks = stalled_with_credentials(port, token, 48)
    try:
        assert_served(port, token)
        assert_answered(socks, (408, True), REQUEST_TIMEOUT + 4)
        assert Job.objects.count() == 1
    finally:
        for sock in socks:
            sock.close()


def test_stalled_bodies_and_idle_connections_at_once(front):
    """The issue's figure: 64 stalled bodies (with credentials) and 1,000 connections
    that send nothing, all open at once → /healthz and an authenticated submission each
    within 1 s, and again after the front has answered the stalled ones 408 and closed
    the silent ones (a connection that never sent a byte gets no answer)."""
    port, token = front
    stalled: list[socket.socket] = []
    idle: list[socket.socket] = []
    try:
        stalled = stalled_with_credentials(port, token, 64)
        idle = [connect(port) for _ in range(1000)]
        assert_served(port, token)
        assert_answered(stalled, (408, True), REQUEST_TIMEOUT + 6)
        assert_answered(idle, (None, True), KEEPALIVE + 6)
        assert_served(port, token)
        assert Job.objects.count() == 2
    finally:
        for sock in stalled + idle:
            sock.close()


def test_the_front_refuses_oversized_bodies_unread_and_hides_metrics(front):
    """A body past the largest any path accepts is refused by the front before it is
    read, in the app's JSON shape, whether announced by Content-Length or chunked (a
    chunked body that fills the front's buffer is never forwarded); /metrics (no
    credentials) is not served through the front."""
    port, token = front
    bound = BATCH_BODY_FACTOR * max_body_bytes()
    auth = f"Authorization: Token {token}"
    with stall(port, "/api/v1/jobs/batch/", auth, length=10 * bound) as sock:
        head, _, body = read_answer(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert json.loads(body)["code"] == "request_too_large"
    with connect(port, timeout=REQUEST_TIMEOUT + 3) as sock:
        size = 2 * bound  # past the front's one buffer: it fills, and is refused
        sock.sendall(f"POST /api/v1/jobs/batch/ HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     f"{size:x}\r\n".encode())  # fmt: skip
        sender = threading.Thread(target=send_quietly, args=(sock, b"[" * size), daemon=True)
        sender.start()
        head, _, body = read_answer(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert json.loads(body)["code"] == "request_too_large"
    with connect(port) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert read_answer(sock).startswith(b"HTTP/1.1 404 ")
    assert Job.objects.count() == 0


def send_quietly(sock: socket.socket, data: bytes) -> None:
    """Send what the server reads before it closes."""
    try:
        sock.sendall(data)
    except OSError:
        pass


def read_until_closed(sock: socket.socket, within: float) -> tuple[bytes, bool]:
    """(everything received, whether the server closed) within `within` seconds."""
    deadline = time.monotonic() + within
    data = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data, False
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def read_answer(sock: socket.socket) -> bytes:
    """One answer: its head and its Content-Length bytes of body."""
    data = b""
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = re.search(rb"(?im)^content-length: *(\d+)", head)
            if length and len(body) >= int(length[1]):
                return data
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
