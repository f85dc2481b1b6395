"""One claim-latency process: claim one job, time the claim statement, complete it; repeat.

Run by the `claim` scenario as `python -m bench.claimer SECONDS`, with the bench's
environment (scratch database). Prints one JSON line: the claim timings in ms.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    seconds = float(sys.argv[1])
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    import django

    django.setup()
    from jobs import services

    try:
        from jobs.services import common
        from jobs.services.claims import plain
    except ImportError:  # a tree from before jobs.services was a package (a baseline)
        common = plain = services

    worker = f"claimer:{os.getpid()}"
    # The same claim statement, also returning how long the server spent on it.
    timed_sql = plain._CLAIM_NEXT_SQL.replace(
        "SELECT id, lease_version,",
        "SELECT extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000, "
        "id, lease_version,",
    )
    assert timed_sql != plain._CLAIM_NEXT_SQL, "the claim statement changed shape"
    params = {
        "queue": "default",
        "limit": batch,
        "worker": worker,
        "actor": services.worker_actor(worker),
        "start": None,
    }
    timings: list[float] = []
    server: list[float] = []
    empty = 0
    # Warm the connection so the first timing is not a connect.
    services.claim_next(worker, ["warmup"], 1)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()  # start gate: all claimers begin together
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        rows = common._hot_rows(timed_sql, params)
        timings.append((time.perf_counter() - t0) * 1000)
        leases = plain._leases([r[1:] for r in rows], worker)
        if rows:
            server.append(float(rows[0][0]))
        if not leases:
            empty += 1
            if empty > 50:
                break
            continue
        services.complete([(lease, None) for lease in leases])
    sys.stdout.write(json.dumps({"claims_ms": timings, "server_ms": server, "empty": empty}) + "\n")


if __name__ == "__main__":
    main()
