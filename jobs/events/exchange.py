"""One POST on a slot's kept-alive connection: a delivery's HTTP/1.1 exchange (D400).

A delivery's call went through urllib3's pool, its request (the head and the body in
two sends) and http.client's answer (the email package's header parser): about 450 µs
of CPU per call on the bench machine, where the exchange itself costs about 100. A
slot keeps one connection per address, the address ssrf.check gave, so a pool adds
nothing. Here the head and the body go out in one send on a socket (TLS by the ssl
module, verified against the URL's host name as urllib3 did), and the answer is read
by httptools' parser (llhttp: Content-Length, chunked and keep-alive as the server
states them). Connect and each read are bounded by the socket's timeouts; the total is
the attempt's Deadline, which shuts the connection down through a duplicate of its
socket (TLS detaches the plain one; the duplicate stays).

Failures are raised as urllib3's exceptions, so the circuit and the attempt's
bookkeeping read them as before: a timeout is a TimeoutError, anything else an
HTTPError.
"""

from __future__ import annotations

import socket
import ssl
import threading
from typing import Protocol
from urllib.parse import quote

import httptools
import urllib3
from urllib3.util.wait import wait_for_read


class Deadline(Protocol):
    """The attempt's total bound (jobs.events.deadline.Deadline), as used here."""

    def watch_shared(self, dup: socket.socket) -> None: ...


# What a request target may hold as it is; anything else (a space, a control or
# non-ASCII character) is percent-encoded, as urllib3 encoded it.
_TARGET_SAFE = "!#$%&'()*+,/:;=?@[]~"
_RECV = 65536

_contexts: dict[str | None, ssl.SSLContext] = {}
_contexts_lock = threading.Lock()


def _tls(ca_bundle: str | None) -> ssl.SSLContext:
    """The client context for a CA bundle (None: the system's), made once."""
    with _contexts_lock:
        context = _contexts.get(ca_bundle)
        if context is None:
            context = ssl.create_default_context(cafile=ca_bundle)
            _contexts[ca_bundle] = context
        return context


class _Answer:
    """httptools' callbacks: the status line's headers and at most `limit` body bytes."""

    __slots__ = ("headers", "body", "limit", "over", "headed", "keep", "complete", "parser")

    def __init__(self, limit: int) -> None:
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.limit = limit
        self.over = False  # the body is longer than the limit: the rest is not read
        self.headed = False
        self.keep = False  # read with the head: llhttp forgets it once the answer ends
        self.complete = False
        self.parser = httptools.HttpResponseParser(self)

    def on_headers_complete(self) -> None:
        self.headed = True
        self.keep = self.parser.should_keep_alive()

    def on_header(self, name: bytes, value: bytes) -> None:
        key, text = name.decode("latin-1"), value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_body(self, body: bytes) -> None:
        room = self.limit - len(self.body)
        if len(body) > room:
            self.over = True
        self.body += body[: max(room, 0)]

    def on_message_complete(self) -> None:
        if 100 <= self.parser.get_status_code() < 200:  # an interim answer: the next is it
            self.headers, self.headed = {}, False
            return
        self.complete = True

    def ends_with_connection(self) -> bool:
        """The head is read and states no length: the body ends when the server closes."""
        return self.headed and not any(
            k.lower() in ("content-length", "transfer-encoding") for k in self.headers
        )


class Connection:
    """A kept-alive connection to `address`:`port` for the URL's `host`."""

    def __init__(self, scheme: str, address: str, port: int, host: str,
                 ca_bundle: str | None) -> None:  # fmt: skip
        self.scheme, self.address, self.port, self.host = scheme, address, port, host
        self.ca_bundle = ca_bundle
        self._sock: socket.socket | None = None
        self._dup: socket.socket | None = None  # what a deadline shuts down

    def post(
        self,
        target: str,
        headers: dict[str, str],
        body: bytes,
        *,
        connect: float,
        read: float,
        deadline: Deadline | None,
        limit: int,
    ) -> tuple[int, bytes, dict]:
        """POST `body` to `target` (path?query); (status, at most `limit` bytes of the
        answer's body, its headers). The connection is kept only when the answer was
        read to its end and the server keeps it alive."""
        head = _head(target, headers, len(body))
        try:
            sock = self._ready(connect, read, deadline)
            sock.sendall(head + body)
            answer = _Answer(limit)
            parser = answer.parser
            while not answer.complete and not answer.over:
                data = sock.recv(_RECV)
                if not data:
                    if not answer.ends_with_connection():
                        raise urllib3.exceptions.ProtocolError(
                            "Connection aborted.", ConnectionError("closed before the answer's end")
                        )
                    answer.complete = True
                    self.close()
                    break
                parser.feed_data(data)
            status = parser.get_status_code()
            if answer.over or not answer.keep:
                self.close()
            return status, bytes(answer.body), answer.headers
        except urllib3.exceptions.HTTPError:
            self.close()
            raise
        except TimeoutError as exc:
            self.close()
            message = f"read timed out: {exc}"
            raise urllib3.exceptions.ReadTimeoutError(None, target, message) from exc
        except ssl.SSLError as exc:
            self.close()
            raise urllib3.exceptions.SSLError(exc) from exc
        except (OSError, httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self.close()
            raise urllib3.exceptions.ProtocolError("Connection aborted.", exc) from exc

    def _ready(self, connect: float, read: float, deadline: Deadline | None) -> socket.socket:
        """The kept-alive socket, or a new one when the server ended it (a socket that is
        readable between answers was closed or written to unasked)."""
        sock = self._sock
        if sock is not None and wait_for_read(sock, timeout=0.0):
            self.close()
            sock = None
        if sock is None:
            sock = self._connect(connect, deadline)
        elif deadline is not None and self._dup is not None:
            deadline.watch_shared(self._dup)
        sock.settimeout(read)
        return sock

    def _connect(self, connect: float, deadline: Deadline | None) -> socket.socket:
        try:
            sock = socket.create_connection((self.address, self.port), timeout=connect)
        except TimeoutError as exc:
            raise urllib3.exceptions.ConnectTimeoutError(
                None, f"connection to {self.host} timed out ({connect:g} s)"
            ) from exc
        except OSError as exc:
            raise urllib3.exceptions.NewConnectionError(
                None, f"failed to connect to {self.host}: {exc}"
            ) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._dup = sock.dup()
        self._sock = sock
        if deadline is not None:
            deadline.watch_shared(self._dup)
        if self.scheme == "https":
            # The handshake runs under the connect timeout and the deadline's shutter.
            self._sock = _tls(self.ca_bundle).wrap_socket(sock, server_hostname=self.host)
        return self._sock

    def close(self) -> None:
        for sock in (self._sock, self._dup):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
        self._sock = self._dup = None


def _head(target: str, headers: dict[str, str], length: int) -> bytes:
    lines = [f"POST {quote(target, safe=_TARGET_SAFE)} HTTP/1.1\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise urllib3.exceptions.ProtocolError(f"header {name!r}: a line break or colon")
        lines.append(f"{name}: {value}\r\n")
    lines.append(f"content-length: {length}\r\n\r\n")
    return "".join(lines).encode("latin-1")
