"""HTTP submission through gunicorn: single jobs and batches of 1000.

The load itself comes from `bench.http_client` processes (standard library only).
"""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.measure import (
    Profiler,
    backend_pids,
    cpu_seconds,
    fmt_pcts,
    percentiles,
    released_together,
    sql,
)
from harness import Service, free_port


def not_measured(name: str) -> dict:
    return {
        "scenario": name,
        "figure": "HTTP submission through gunicorn",
        "value": None,
        "unit": "jobs/s",
        "note": "NOT MEASURED: the REST API (jobs/api/) is not on this branch yet",
    }


def _gunicorn(ctx: Any, code: Any, web_concurrency: int | None) -> tuple[Service, str]:
    """gunicorn from `code`'s tree with that tree's own defaults (gunicorn.conf.py), unless
    --web-concurrency says how many workers."""
    port = free_port()
    web = {"WEB_CONCURRENCY": str(web_concurrency)} if web_concurrency else {}
    server = ctx.procs.api(
        port,
        root=code.root,
        LOG_LEVEL="WARNING",
        JOBS_MAX_QUEUE_DEPTH="100000000",
        JOBS_API_THROTTLE="100000000/minute",
        **web,
    )
    return server, f"http://127.0.0.1:{port}"


def _children(pid: int) -> list[int]:
    """gunicorn's master and its workers."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    return [pid, *map(int, kids)]


def _load(ctx: Any, url: str, body: Any, seconds: float, clients: int, threads: int) -> dict:
    from jobs.models import Client

    _, token = Client.create_with_token(f"bench-{secrets.token_hex(6)}")
    body_file = ctx.logdir / f"body-{id(body)}.json"
    body_file.write_text(json.dumps(body))
    argv = [sys.executable, "-m", "bench.http_client", url, token, str(body_file), str(seconds),
            str(threads)]  # fmt: skip
    docs = released_together(argv, clients, timeout=seconds + 120)
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    elapsed = 0.0
    for doc in docs:
        for k, v in doc["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
        latencies.extend(doc["latencies_ms"])
        elapsed = max(elapsed, doc["seconds"])
    return {"statuses": statuses, "latencies": latencies, "seconds": elapsed}


def _run(
    ctx: Any, code: Any, name: str, body: Any, jobs_per_request: int, clients: int, threads: int
):
    web = ctx.args.web_concurrency
    seconds = 2.0 if ctx.quick else 10.0
    server, url = _gunicorn(ctx, code, web)
    path = "/api/v1/jobs/batch/" if jobs_per_request > 1 else "/api/v1/jobs/"
    # Each gunicorn worker imports the URLconf, DRF and the schema code on its first
    # requests: warm them up so the figures (and CPU per request) are the steady state.
    _load(ctx, url + path, body, 0.5 if ctx.quick else 1.5, clients, threads)
    before = sql("SELECT coalesce(max(id), 0) FROM jobs_job")[0][0]
    profiler = Profiler(ctx.args.profile, [server], f"{name}-{code.label}")
    # CPU per request of the API's processes and their database backends: on a busy
    # machine, a steadier side-by-side figure than requests per second.
    web_pids = _children(server.pid)
    cpu0 = cpu_seconds(web_pids), cpu_seconds(backend_pids())
    got = _load(ctx, url + path, body, seconds, clients, threads)
    cpu1 = cpu_seconds(web_pids), cpu_seconds(backend_pids())
    profiler.stop()
    server.stop()
    created = sql(
        "SELECT count(*), min(created_at), max(created_at) FROM jobs_job WHERE id > %s", [before]
    )[0]
    ok = got["statuses"].get("201", 0)
    pct = percentiles(got["latencies"])
    jobs = ok * jobs_per_request
    db_span = (created[2] - created[1]).total_seconds() if created[0] > 1 else 0.0
    target = ">= 30,000 jobs/s" if jobs_per_request > 1 else ">= 1,500 jobs/s"
    return {
        "scenario": name,
        "code": code.label,
        "figure": f"HTTP POST {path} through gunicorn "
        f"({f'{web} workers' if web else 'its gunicorn.conf.py defaults'}), "
        f"{jobs_per_request} job(s) per request",
        "value": jobs / got["seconds"],
        "unit": "jobs/s",
        "target": target,
        "summary": f"{ok} x 201 in {got['seconds']:.2f}s ({ok / got['seconds']:,.0f} req/s), "
        f"statuses {got['statuses']}, {created[0]} rows; request latency "
        + (fmt_pcts(pct) if pct else "-")
        + f"; {clients}x{threads} client threads; CPU per request: gunicorn "
        f"{1000 * (cpu1[0] - cpu0[0]) / max(ok, 1):.2f} ms, PostgreSQL "
        f"{1000 * (cpu1[1] - cpu0[1]) / max(ok, 1):.2f} ms",
        "details": {
            "requests_ok": ok,
            "statuses": got["statuses"],
            "seconds": got["seconds"],
            "rows": created[0],
            "db_span_s": db_span,
            "latency_ms": pct,
            "web_concurrency": web,
            "client_threads": clients * threads,
            "gunicorn_cpu_ms_per_request": 1000 * (cpu1[0] - cpu0[0]) / max(ok, 1),
            "postgres_cpu_ms_per_request": 1000 * (cpu1[1] - cpu0[1]) / max(ok, 1),
        },
    }


def single(ctx: Any) -> Iterator[dict]:
    """8 client threads (2 processes x 4), each code's gunicorn in turn (baseline first)."""
    for code in ctx.codes():
        yield _run(ctx, code, "http-single", {"task": "echo", "payload": {"n": 1}}, 1, 2, 4)


def bulk(ctx: Any) -> Iterator[dict]:
    size = 1000
    body = {"jobs": [{"task": "echo", "payload": {"n": n}} for n in range(size)]}
    for code in ctx.codes():
        yield _run(ctx, code, "http-bulk", body, size, 1, 2)
