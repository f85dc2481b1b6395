"""Hostile HTTP clients as real sockets on loopback: bodies that stall, connections that
say nothing. The slow-client tests open them once; the bench holds a number of them open
for a whole measurement (`Held`).
"""

from __future__ import annotations

import itertools
import selectors
import socket
import threading
from collections.abc import Callable

CSRF = "c" * 32  # a well-formed csrftoken cookie: CsrfViewMiddleware then reads the form


def connect(port: int, timeout: float = 5) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def stall(port: int, path: str, *headers: str, length: int = 1000) -> socket.socket:
    """Announce `length` bytes of body, send one, and stop."""
    sock = connect(port)
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {length}", *headers]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + b"{")
    return sock


def credentialed_stalls(port: int, token: str) -> Callable[[], socket.socket]:
    """An opener of bodies that stall with credentials, in turn: a single submission with
    a token (the lane), a batch with a token (DRF), an admin login form with a
    `csrftoken` cookie. On the plain server each takes a request thread."""
    auth, body = f"Authorization: Token {token}", "Content-Type: application/json"
    form = ("Content-Type: application/x-www-form-urlencoded", f"Cookie: csrftoken={CSRF}")
    kinds = itertools.cycle([
        ("/api/v1/jobs/", (auth, body)),
        ("/api/v1/jobs/batch/", (auth, body)),
        ("/admin/login/", form),
    ])  # fmt: skip

    def opener() -> socket.socket:
        path, headers = next(kinds)
        return stall(port, path, *headers)

    return opener


class Held:
    """`count` connections made by `opener`, kept open: a thread reopens each one the
    server closes or answers, so the count holds until `stop()`. `replaced` counts them."""

    def __init__(self, opener: Callable[[], socket.socket], count: int) -> None:
        self.opener = opener
        self.count = count
        self.replaced = 0
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="held-connections", daemon=True)

    def _open(self) -> None:
        sock = self.opener()
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ)

    def start(self) -> Held:
        for _ in range(self.count):
            self._open()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.2):
                sock = key.fileobj
                self._selector.unregister(sock)
                sock.close()  # closed, reset or answered: this one no longer holds anything
                self.replaced += 1
                if not self._stop.is_set():
                    try:
                        self._open()
                    except OSError:
                        pass  # refused for now: the next round opens fewer

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(10)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()
        return self.replaced
