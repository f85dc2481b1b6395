"""A webhook receiver in a process of its own, for the bench's delivery figures.

`harness.receiver.Recording` is an `http.server` in the caller's process: about 226 µs
of CPU a call, taken from the two cores and the interpreter the bench measures with. A
receiver that "answers 200 at once" should cost the machine little and nothing of the
bench's own process, so this one is an asyncio server with httptools' parser in a child
process, noting the same facts (webhook-id, time, code, body) and answering the same
seeded 500s. The caller reads them over two control requests: `GET /_count` (distinct
webhook-ids answered 200) while it waits, `GET /_calls` once at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from harness.receiver import first_200s

ROOT = Path(__file__).resolve().parents[1]


def _answer(code: int, body: bytes, retry_after: str, close: bool) -> bytes:
    head = [f"HTTP/1.1 {code} {'OK' if code == 200 else 'Internal Server Error'}",
            f"Content-Length: {len(body)}", "Content-Type: application/json"]  # fmt: skip
    if code == 500:
        head.append(f"Retry-After: {retry_after}")
    if close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def serve(fail: float, seed: int, retry_after: str) -> None:
    """The child: serve until stdin closes; the port goes to stdout first."""
    import asyncio

    import httptools

    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - the stdlib loop is the same server, slower
        pass

    rng = random.Random(seed)
    calls: list[tuple[str, float, int, bytes]] = []
    delivered: set[str] = set()

    def control(path: bytes) -> bytes:
        if path == b"/_count":
            return str(len(delivered)).encode()
        out = []
        for msg_id, at, code, body in calls:
            data = json.loads(body)["data"]
            out.append([msg_id, data["id"], data["seq"], at, code, body.decode()])
        return json.dumps(out).encode()

    class Connection(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport = transport
            transport.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # fmt: skip
            self.parser = httptools.HttpRequestParser(self)
            self.url = b""
            self.msg_id = ""
            self.body: list[bytes] = []

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()

        def on_message_begin(self) -> None:
            self.url, self.msg_id, self.body = b"", "", []

        def on_url(self, url: bytes) -> None:
            self.url += url

        def on_header(self, name: bytes, value: bytes) -> None:
            if name.lower() == b"webhook-id":
                self.msg_id = value.decode()

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            close = not self.parser.should_keep_alive()
            if self.parser.get_method() == b"GET":
                answer = _answer(200, control(self.url), retry_after, close)
            else:
                code = 500 if rng.random() < fail else 200
                calls.append((self.msg_id, time.time(), code, b"".join(self.body)))
                if code == 200:
                    delivered.add(self.msg_id)
                answer = _answer(code, b"ok", retry_after, close)
            self.transport.write(answer)
            if close:
                self.transport.close()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Connection, "127.0.0.1", 0, backlog=512)
        print(server.sockets[0].getsockname()[1], flush=True)
        # The parent's end of stdin closing is the stop: no orphan outlives the bench.
        await loop.run_in_executor(None, sys.stdin.buffer.read)
        server.close()

    asyncio.run(main())


class ReceiverProcess:
    """The parent's handle, in the shape of `harness.receiver.Recording`: `url`,
    `delivered()`, `snapshot()`, `close()`; `count()` is the cheap check to wait on."""

    def __init__(self, fail: float = 0.0, seed: int = 41, retry_after: str = "1") -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "harness.receiver_process", "--fail", str(fail),
             "--seed", str(seed), "--retry-after", retry_after],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env,
        )  # fmt: skip
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the receiver process did not start")
        self.port = int(line)
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self._lock = threading.Lock()
        self._conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def _get(self, path: str) -> bytes:
        with self._lock:
            self._conn.request("GET", path)
            return self._conn.getresponse().read()

    def count(self) -> int:
        """How many webhook-ids were answered 200 so far."""
        return int(self._get("/_count"))

    def snapshot(self) -> tuple[list[tuple[str, int, int, float, int]], dict[str, set[str]]]:
        """Every call (webhook-id, job, seq, time, code) and each id's distinct bodies."""
        calls, bodies = [], defaultdict(set)
        for msg_id, job, seq, at, code, body in json.loads(self._get("/_calls")):
            calls.append((msg_id, job, seq, at, code))
            bodies[msg_id].add(body)
        return calls, bodies

    def delivered(self) -> dict[str, float]:
        """webhook-id → time of its first 200."""
        return first_200s(self.snapshot()[0])

    def close(self) -> None:
        self._conn.close()
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=41)
    parser.add_argument("--retry-after", default="1")
    args = parser.parse_args()
    serve(args.fail, args.seed, args.retry_after)
