"""A small HTTP load generator, the client side of `bench.http_load`: threads POSTing one
body in a loop for a fixed time.

`python -m bench.http_client URL TOKEN BODY_FILE SECONDS THREADS` prints "ready", waits for a
line on stdin (the start gate), runs, then prints one JSON line: status counts and the
request latencies in ms. No dependencies beyond the standard library.
"""

from __future__ import annotations

import http.client
import json
import resource
import sys
import threading
import time
from collections import Counter
from urllib.parse import urlsplit


def main() -> None:
    url, token, body_file, seconds, threads = sys.argv[1:6]
    body = open(body_file, "rb").read()
    parts = urlsplit(url)
    headers = {
        "Authorization": f"Token {token}",
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
    }
    statuses: Counter[int] = Counter()
    latencies: list[float] = []
    lock = threading.Lock()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_at_start = usage.ru_utime + usage.ru_stime
    deadline = time.monotonic() + float(seconds)

    def loop() -> None:
        mine: list[float] = []
        codes: Counter[int] = Counter()
        conn = None
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
                conn.request("POST", parts.path, body=body, headers=headers)
                resp = conn.getresponse()
                resp.read()
                codes[resp.status] += 1
                if resp.will_close:
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException):
                codes[0] += 1
                conn = None
                continue
            mine.append((time.perf_counter() - t0) * 1000)
        with lock:
            latencies.extend(mine)
            statuses.update(codes)

    workers = [threading.Thread(target=loop) for _ in range(int(threads))]
    started = time.monotonic()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    elapsed = time.monotonic() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    doc = {
        "statuses": dict(statuses),
        "latencies_ms": latencies,
        "seconds": elapsed,
        "cpu_seconds": usage.ru_utime + usage.ru_stime - cpu_at_start,
    }
    sys.stdout.write(json.dumps(doc) + "\n")


if __name__ == "__main__":
    main()
