"""A threaded HTTP server on a free loopback port: the webhook receivers of the tests and
the bench (each brings its own handler: what it answers is what it tests)."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import defaultdict
from collections.abc import Collection, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve_on_loopback(
    handler: type[BaseHTTPRequestHandler], path: str = "/hook"
) -> tuple[ThreadingHTTPServer, str]:
    """Start `handler` on 127.0.0.1 in a daemon thread; the server and the URL of `path`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}{path}"


def first_200s(calls: Iterable[tuple[str, int, int, float, int]]) -> dict[str, float]:
    """webhook-id → time of its first 200, from a receiver's calls (id, job, seq, time,
    code) in the order they came."""
    out: dict[str, float] = {}
    for msg_id, _, _, at, code in calls:
        if code == 200 and msg_id not in out:
            out[msg_id] = at
    return out


class Recording:
    """A webhook receiver (HTTP/1.1, kept-alive connections) on 127.0.0.1 that notes each
    call: webhook-id, job, seq, time, code. It answers 200 at once, or 500 with
    Retry-After `retry_after` to a `fail` share of the calls (seeded) and to the calls
    numbered in `fail_calls` (from 1)."""

    def __init__(self, fail: float = 0.0, seed: int = 41, fail_calls: Collection[int] = (),
                 retry_after: str = "1") -> None:  # fmt: skip
        self.fail = fail
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.calls: list[tuple[str, int, int, float, int]] = []
        self.bodies: dict[str, set[str]] = defaultdict(set)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # The head and the body are two writes: with Nagle's algorithm the body
            # waits for the sender's delayed ACK (40 ms) on a kept-alive connection.
            disable_nagle_algorithm = True

            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                data = json.loads(body)["data"]
                msg_id = self.headers["webhook-id"]
                with receiver.lock:
                    failing = receiver.random.random() < receiver.fail
                    code = 500 if failing or len(receiver.calls) + 1 in fail_calls else 200
                    receiver.calls.append((msg_id, data["id"], data["seq"], time.time(), code))
                    receiver.bodies[msg_id].add(body.decode())
                self.send_response(code)
                if code == 500:
                    self.send_header("Retry-After", retry_after)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server, self.url = serve_on_loopback(Handler)

    def delivered(self) -> dict[str, float]:
        """webhook-id → time of its first 200."""
        with self.lock:
            return first_200s(self.calls)

    def snapshot(self) -> tuple[list[tuple[str, int, int, float, int]], dict[str, set[str]]]:
        """Every call (webhook-id, job, seq, time, code) and each id's distinct bodies."""
        with self.lock:
            return list(self.calls), {k: set(v) for k, v in self.bodies.items()}

    def count(self) -> int:
        """How many webhook-ids were answered 200 so far."""
        with self.lock:
            return len({c[0] for c in self.calls if c[4] == 200})

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
