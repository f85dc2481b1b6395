"""A threaded HTTP server on a free loopback port: the webhook receivers of the tests and
the bench (each brings its own handler: what it answers is what it tests)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve_on_loopback(
    handler: type[BaseHTTPRequestHandler], path: str = "/hook"
) -> tuple[ThreadingHTTPServer, str]:
    """Start `handler` on 127.0.0.1 in a daemon thread; the server and the URL of `path`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}{path}"
