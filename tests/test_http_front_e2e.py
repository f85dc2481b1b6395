"""Slow clients against the deployment's front: nginx as `python -m jobservice.proxy`
renders it, in front of `python -m jobservice.serve` (issue 39 items 2 and 3; D204-D206).

The plain server gives a request thread to any body that stalls with a token, or to an
admin login form with a `csrftoken` cookie (CsrfViewMiddleware reads it): 16 such
connections per process starve it. Through the front, the app sees only complete
requests: the stalled ones wait in nginx and are cut at its body timeout.

Every test opens a bounded number of real sockets and bounds every wait.
"""

from __future__ import annotations

import json
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import nginx
from harness.nginx import Nginx
from harness.slow_clients import connect, credentialed_stalls, stall
from jobs.api.parsers import BATCH_BODY_FACTOR, max_body_bytes
from jobs.models import Client, Job
from tests.test_http_edge_e2e import answer, api, assert_served

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(nginx.available() is not None, reason=str(nginx.available())),
]

BODY_TIMEOUT = 3  # PROXY_BODY_TIMEOUT: the longest pause between two reads of a body
HEADER_TIMEOUT = 8  # PROXY_HEADER_TIMEOUT: the headers' deadline, and the idle bound


@pytest.fixture
def front(transactional_db, tmp_path):
    """(the front's port, a token): nginx on a free port in front of a real API server of
    two processes of four threads."""
    _, token = Client.create_with_token("front")
    server = api(tmp_path)
    proxy = Nginx(
        server.port,
        {
            **server.server.env,
            "PROXY_BODY_TIMEOUT": str(BODY_TIMEOUT),
            "PROXY_HEADER_TIMEOUT": str(HEADER_TIMEOUT),
        },
    )
    try:
        proxy.start()
        yield proxy.port, token
        assert proxy.service.alive(), proxy.log()
    finally:
        assert proxy.stop() == 0
        assert server.stop() == 0


def stalled_with_credentials(port: int, token: str, count: int) -> list[socket.socket]:
    """`count` stalled bodies, in turn a lane submission, a batch (DRF) and an admin
    login (a form with a csrftoken cookie)."""
    opener = credentialed_stalls(port, token)
    return [opener() for _ in range(count)]


def assert_cut_within(socks: list[socket.socket], seconds: float) -> None:
    """Each connection is cut by the server within `seconds` with no answer: nginx logs
    a 408 for headers or a body that stopped, sends nothing and resets the connection
    (reset_timedout_connection); a connection that sent nothing is closed."""
    started = time.monotonic()
    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(lambda s: answer(s, seconds), socks))
    took = time.monotonic() - started
    assert answers == [(None, True)] * len(socks), answers
    assert took < seconds, took


def test_stalled_bodies_with_credentials_wait_in_the_front(front):
    """Item 2 with credentials: 16 stalled lane submissions, 16 stalled batches and 16
    stalled admin logins (48, six times the eight request threads) → /healthz and a
    submission are answered within 1 s; each stalled connection is closed within the body
    timeout, and none of them reached the app (no job was created from them)."""
    port, token = front
    socks = stalled_with_credentials(port, token, 48)
    try:
        assert_served(port, token)
        assert_cut_within(socks, BODY_TIMEOUT + 4)
        assert Job.objects.count() == 1
    finally:
        for sock in socks:
            sock.close()


def test_stalled_bodies_and_idle_connections_at_once(front):
    """The issue's figure: 64 stalled bodies (with credentials) and 1,000 connections
    that send nothing, all open at once → /healthz and an authenticated submission each
    within 1 s, and again after the front has cut them all."""
    port, token = front
    socks: list[socket.socket] = []
    try:
        socks = stalled_with_credentials(port, token, 64)
        socks += [connect(port) for _ in range(1000)]
        assert_served(port, token)
        assert_cut_within(socks, HEADER_TIMEOUT + 6)
        assert_served(port, token)
        assert Job.objects.count() == 2
    finally:
        for sock in socks:
            sock.close()


def test_the_front_refuses_oversized_bodies_unread_and_hides_metrics(front):
    """A body past the largest any path accepts is refused by nginx before it is read,
    in the app's JSON shape; /metrics (no credentials) is not served through the front."""
    port, token = front
    with stall(port, "/api/v1/jobs/batch/", f"Authorization: Token {token}",
               length=10 * BATCH_BODY_FACTOR * max_body_bytes()) as sock:  # fmt: skip
        head, _, body = read_answer(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert json.loads(body)["code"] == "request_too_large"
    with connect(port) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert read_answer(sock).startswith(b"HTTP/1.1 404 ")
    assert Job.objects.count() == 0


def read_answer(sock: socket.socket) -> bytes:
    """One answer: its head and its Content-Length bytes of body (nginx keeps a refused
    connection open a while to drain the client's body, so the close comes later)."""
    data = b""
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = re.search(rb"(?im)^content-length: *(\d+)", head)
            if length and len(body) >= int(length[1]):
                return data
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
