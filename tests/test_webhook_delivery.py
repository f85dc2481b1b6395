"""One delivery attempt over real sockets (issue 16): https to the checked address with the
URL's name for TLS and Host, a bounded read of the answer, Retry-After parsing."""

from __future__ import annotations

import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import urllib3

from jobs.events.webhooks import post, retry_after


def certificate(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}",
         "-addext", f"subjectAltName=DNS:{name}"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


class Server:
    """A real HTTP(S) server on 127.0.0.1 recording each request's Host header."""

    def __init__(self, tls: tuple[Path, Path] | None = None, answer: bytes = b"ok") -> None:
        self.hosts: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["content-length"]))
                server.hosts.append(self.headers["host"])
                self.send_response(200)
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_https_goes_to_the_checked_address_with_the_urls_name(settings, tmp_path):
    tls = certificate(tmp_path, "localhost")
    settings.JOBS_WEBHOOK_CA_BUNDLE = str(tls[0])
    server = Server(tls)
    try:
        code, _, _ = post(f"https://localhost:{server.port}/h", "127.0.0.1", {}, "{}")
        assert code == 200 and server.hosts == [f"localhost:{server.port}"]
    finally:
        server.close()


def test_https_refuses_a_certificate_for_another_name(settings, tmp_path):
    other = certificate(tmp_path, "other.test")
    settings.JOBS_WEBHOOK_CA_BUNDLE = str(other[0])
    server = Server(other)
    try:
        with pytest.raises(urllib3.exceptions.HTTPError):
            post(f"https://localhost:{server.port}/h", "127.0.0.1", {}, "{}")
        assert server.hosts == []
    finally:
        server.close()


def test_only_the_first_bytes_of_an_answer_are_read(settings):
    settings.JOBS_WEBHOOK_MAX_RESPONSE_BYTES = 100
    server = Server(answer=b"x" * 5_000_000)
    try:
        code, head, _ = post(f"http://127.0.0.1:{server.port}/h", "127.0.0.1", {}, "{}")
        assert code == 200 and len(head) == 100
    finally:
        server.close()


@pytest.mark.parametrize(
    "value, expected",
    [("7", 7.0), ("999999", 3600.0), ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0), ("soon", None),
     (None, None)],
    ids=["seconds", "capped", "past-date", "junk", "absent"],
)  # fmt: skip
def test_retry_after(value, expected):
    assert retry_after({} if value is None else {"Retry-After": value}) == expected
