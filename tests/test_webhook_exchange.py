"""A delivery's POST on a kept-alive socket (jobs.events.exchange, D400), against real
receivers on 127.0.0.1 that answer what each test states, byte for byte: reuse of the
connection, the answer's framings (length, chunked, until close, an interim 1xx), the
cap on what is read, a connection the server ended, and the errors callers read."""

from __future__ import annotations

import re
import socket
import ssl
import threading

import pytest
import urllib3

from jobs.events import exchange
from jobs.events.deadline import DeadlineExceeded
from jobs.events.endpoints import Slot
from jobs.events.webhooks import post
from tests.test_webhook_containment import certificate

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Scripted:
    """Answers each request with the next of `answers` (bytes, or None: close without
    answering); notes every connection and request. `close_after`: close the
    connection after that many answers on it."""

    def __init__(self, answers: list[bytes | None], close_after: int = 0) -> None:
        self.answers = list(answers)
        self.close_after = close_after
        self.connections = 0
        self.requests: list[bytes] = []
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        served, data = 0, b""
        try:
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, data = data.partition(b"\r\n\r\n")
                length = int(re.search(rb"(?im)^content-length:\s*(\d+)", head).group(1))
                while len(data) < length:
                    data += conn.recv(65536)
                body, data = data[:length], data[length:]
                with self.lock:
                    self.requests.append(head + b"\r\n\r\n" + body)
                    answer = self.answers.pop(0) if self.answers else OK
                if answer is None:
                    return
                conn.sendall(answer)
                served += 1
                if self.close_after and served >= self.close_after:
                    return
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def receiver():
    made: list[Scripted] = []

    def make(answers: list[bytes | None], close_after: int = 0) -> Scripted:
        made.append(Scripted(answers, close_after))
        return made[-1]

    yield make
    for r in made:
        r.close()


def call(conn: exchange.Connection, target: str = "/h", limit: int = 1000, **headers: str):
    return conn.post(target, headers or {"host": "127.0.0.1"}, b'{"a": 1}', connect=2.0,
                     read=2.0, deadline=None, limit=limit)  # fmt: skip


def test_one_connection_carries_every_call_and_each_request_is_whole(receiver):
    r = receiver([])
    conn = exchange.Connection("http", "127.0.0.1", r.port, "127.0.0.1", None)
    try:
        answers = [call(conn, **{"host": "example.com", "webhook-id": f"msg_{i}"})
                   for i in range(20)]  # fmt: skip
    finally:
        conn.close()
    assert {(code, body) for code, body, _ in answers} == {(200, b"ok")}
    assert r.connections == 1
    assert len(r.requests) == 20
    first = r.requests[0]
    assert first.startswith(b"POST /h HTTP/1.1\r\n")
    assert b"\r\nhost: example.com\r\n" in first and b"\r\nwebhook-id: msg_0\r\n" in first
    assert first.endswith(b'content-length: 8\r\n\r\n{"a": 1}')


def test_the_answers_framings_are_read_to_their_end(receiver):
    chunked = (b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\nRetry-After: 7\r\n\r\n"
               b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n")  # fmt: skip
    interim = b"HTTP/1.1 100 Continue\r\n\r\n" + OK
    r = receiver([chunked, interim, b"HTTP/1.1 204 No Content\r\n\r\n"])
    conn = exchange.Connection("http", "127.0.0.1", r.port, "127.0.0.1", None)
    try:
        code, body, headers = call(conn)
        assert (code, body, headers["Retry-After"]) == (500, b"abcdefg", "7")
        assert call(conn)[:2] == (200, b"ok")  # the 100 is not the answer
        assert call(conn)[:2] == (204, b"")
    finally:
        conn.close()
    assert r.connections == 1  # each answer was read to its end: the connection was kept


def test_an_answer_that_ends_with_the_connection_is_read_and_not_kept(receiver):
    r = receiver([b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it"], close_after=1)
    conn = exchange.Connection("http", "127.0.0.1", r.port, "127.0.0.1", None)
    try:
        assert call(conn)[:2] == (200, b"all of it")
        assert call(conn)[:2] == (200, b"ok")
    finally:
        conn.close()
    assert r.connections == 2


def test_a_longer_answer_is_cut_at_the_limit_and_its_connection_dropped(receiver):
    r = receiver([b"HTTP/1.1 400 Bad\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000])
    conn = exchange.Connection("http", "127.0.0.1", r.port, "127.0.0.1", None)
    try:
        code, body, _ = call(conn, limit=100)
        assert (code, body) == (400, b"x" * 100)
        assert call(conn)[:2] == (200, b"ok")  # on a new connection: the rest was not read
    finally:
        conn.close()
    assert r.connections == 2


def test_a_connection_the_server_ended_between_calls_is_replaced_without_a_failure(receiver):
    r = receiver([], close_after=1)
    conn = exchange.Connection("http", "127.0.0.1", r.port, "127.0.0.1", None)
    try:
        for _ in range(3):
            assert call(conn)[:2] == (200, b"ok")
            # The server closes after each answer; the next call finds the socket readable
            # (at its end) and connects anew instead of failing on it.
            threading.Event().wait(0.05)
    finally:
        conn.close()
    assert r.connections == 3


def test_what_goes_wrong_is_raised_as_urllib3s_errors(receiver):
    upgrade = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    r = receiver([None, b"NOT HTTP AT ALL\r\n\r\n", upgrade])
    conn = exchange.Connection("http", "127.0.0.1", r.port, "127.0.0.1", None)
    with pytest.raises(urllib3.exceptions.ProtocolError, match="before the answer"):
        call(conn)
    with pytest.raises(urllib3.exceptions.ProtocolError):
        call(conn)
    with pytest.raises(urllib3.exceptions.ProtocolError):  # 101: not an answer to a POST
        call(conn)
    with pytest.raises(urllib3.exceptions.ProtocolError, match="line break"):
        call(conn, **{"host": "x", "x-evil": "a\r\nx-injected: 1"})
    conn.close()
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(urllib3.exceptions.NewConnectionError):
        call(exchange.Connection("http", "127.0.0.1", port, "127.0.0.1", None))
    # A receiver that accepts and says nothing: the read timeout, a TimeoutError.
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        quiet = exchange.Connection("http", "127.0.0.1", silent.getsockname()[1], "x", None)
        with pytest.raises(urllib3.exceptions.TimeoutError):
            quiet.post("/h", {"host": "x"}, b"{}", connect=1.0, read=0.3, deadline=None,
                       limit=10)  # fmt: skip
    finally:
        silent.close()


def test_a_target_is_sent_percent_encoded(receiver):
    r = receiver([])
    conn = exchange.Connection("http", "127.0.0.1", r.port, "127.0.0.1", None)
    try:
        call(conn, target="/hooks/a b/é?x=1&y=%20")
    finally:
        conn.close()
    assert r.requests[0].startswith(b"POST /hooks/a%20b/%C3%A9?x=1&y=%20 HTTP/1.1\r\n")


def test_tls_is_verified_against_the_urls_host_name(tmp_path, settings):
    cert, key = certificate(tmp_path, "localhost")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                raw, _ = server.accept()
            except OSError:
                return
            try:
                with context.wrap_socket(raw, server_side=True) as conn:
                    data = b""
                    while not data.endswith(b"{}"):
                        data += conn.recv(65536)
                    conn.sendall(OK)
            except (OSError, ssl.SSLError):
                pass  # the client refused the certificate

    threading.Thread(target=serve, daemon=True).start()
    try:
        good = exchange.Connection("https", "127.0.0.1", port, "localhost", str(cert))
        assert good.post("/h", {"host": "localhost"}, b"{}", connect=2, read=2, deadline=None,
                         limit=10)[:2] == (200, b"ok")  # fmt: skip
        good.close()
        wrong = exchange.Connection("https", "127.0.0.1", port, "example.com", str(cert))
        with pytest.raises(urllib3.exceptions.SSLError):
            wrong.post("/h", {"host": "example.com"}, b"{}", connect=2, read=2, deadline=None,
                       limit=10)  # fmt: skip
        # Through the delivery's own call: the slot keeps the verified connection.
        settings.JOBS_WEBHOOK_CA_BUNDLE = str(cert)
        slot = Slot(1, 0, None)
        assert post(f"https://localhost:{port}/h", "127.0.0.1", {}, "{}", slot=slot)[0] == 200
        assert len(slot.connections) == 1
        slot.close_connections()
    finally:
        server.close()


def test_an_attempt_past_its_deadline_is_a_deadline_exceeded():
    server = socket.create_server(("127.0.0.1", 0))
    hold = threading.Event()

    def accept() -> None:
        c, _ = server.accept()
        hold.wait(5)
        c.close()

    threading.Thread(target=accept, daemon=True).start()
    try:
        with pytest.raises(DeadlineExceeded, match="within 0.4 s"):
            post(f"http://127.0.0.1:{server.getsockname()[1]}/h", "127.0.0.1", {}, "{}",
                 seconds=0.4)  # fmt: skip
    finally:
        hold.set()
        server.close()
